"""A method that breaks the engine's contract, registered through the `kvtrim.methods` entry point of this
folder's dist-info (put the folder on PYTHONPATH): its kept count depends on the keys (their width), so
the scheduler's stand-in (head_dim 8) predicts a count the worker's real keys (head_dim 64) do not give.
The server must end such a request with an error and go on serving the others (tests/test_vllm_server.py)."""

from dataclasses import dataclass

from kvtrim import register_method
from kvtrim.methods import ScoringMethod
from kvtrim.methods.base import Phase
from kvtrim.methods.knorm import KNorm
from kvtrim.methods.snapkv import SnapKV
from kvtrim.methods.tova import TOVA


@register_method
@dataclass(kw_only=True)
class WidthDependent(ScoringMethod):
    name = "width_dependent"
    summary = "test only: KNorm keeping one entry fewer when keys are wider than 8"

    def score(self, view):
        return -view.keys.float().norm(dim=-1)

    def target(self, view):
        n = super().target(view)
        return None if n is None else n - int(view.keys.shape[-1] > 8)


@register_method
@dataclass(kw_only=True)
class RaisesInScore(ScoringMethod):
    """A method whose `score` raises on the worker's real keys (the scheduler counts it by schedule, without
    keys: it never scores there): the server must end its request with an error its client sees (HTTP 500,
    or an error event when streaming) and go on serving the others."""

    name = "raises_in_score"
    summary = "test only: KNorm whose score raises on keys wider than 8"

    def score(self, view):
        if view.keys.shape[-1] != 8:  # the stand-in keys (head_dim 8), should a planner ever score them
            raise RuntimeError("raises_in_score: the score failed on purpose")
        return -view.keys.float().norm(dim=-1)


@register_method
@dataclass(kw_only=True)
class RaisesOnRankOne(ScoringMethod):
    """A method whose `score` raises on tensor-parallel rank 1 only (rank 0 and one worker compact fine): vLLM
    hands the scheduler rank 0's output, so the server must still end its request with an error its client sees
    (tests/test_vllm_parallel.py)."""

    name = "raises_on_rank_one"
    summary = "test only: KNorm whose score raises on tensor-parallel rank 1"

    def score(self, view):
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - no vLLM, or no parallel group (a planner's process)
            rank = 0
        if rank == 1:
            raise RuntimeError("raises_on_rank_one: the score failed on purpose")
        return -view.keys.float().norm(dim=-1)


@register_method
@dataclass(kw_only=True)
class RaisesInOnAttention(TOVA):
    """TOVA whose `on_attention` raises at decode steps (the scheduler counts TOVA by its schedule: it never calls
    it): on the worker, alone or decided in a batch with requests of its own method, its requests end with an
    error and the others go on (tests/test_vllm_attention.py)."""

    name = "raises_in_on_attention"
    summary = "test only: TOVA whose on_attention raises at decode steps"

    def on_attention(self, view):
        if view.phase is Phase.DECODE:
            raise RuntimeError("raises_in_on_attention: on_attention failed on purpose")
        return super().on_attention(view)


def _in_a_worker() -> bool:
    """True in a vLLM worker process (its tensor-parallel group exists), False in the scheduler's and elsewhere."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        get_tensor_model_parallel_rank()
        return True
    except Exception:  # noqa: BLE001 - no vLLM, or no parallel group
        return False


@register_method
@dataclass(kw_only=True)
class RaisesInWorkerPromptQueries(SnapKV):
    """SnapKV whose `prompt_queries` raises in the worker (where each prompt forward asks it which query rows to
    copy), not in the scheduler: its request ends with an error before its forward, the others go on."""

    name = "raises_in_worker_prompt_queries"
    summary = "test only: SnapKV whose prompt_queries raises in vLLM's worker"

    def prompt_queries(self):
        if _in_a_worker():
            raise RuntimeError("raises_in_worker_prompt_queries: prompt_queries failed on purpose")
        return super().prompt_queries()


@register_method
@dataclass(kw_only=True)
class RaisesInSchedule(KNorm):
    """KNorm whose `schedule` raises (the scheduler asks it of each request it adds): the server's front end asks it
    first and answers a 400 with the one line."""

    name = "raises_in_schedule"
    summary = "test only: KNorm whose schedule raises"

    def schedule(self):
        raise RuntimeError("raises_in_schedule: schedule failed on purpose")


@register_method
@dataclass(kw_only=True)
class RaisesInRepr(KNorm):
    """KNorm whose `repr` raises (a shared context's key holds it): the server's front end asks it first and answers
    a 400 with the one line."""

    name = "raises_in_repr"
    summary = "test only: KNorm whose repr raises"

    def __repr__(self):
        raise RuntimeError("raises_in_repr: repr failed on purpose")

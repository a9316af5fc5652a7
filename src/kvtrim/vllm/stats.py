"""What kvtrim's vLLM worker counts of its steps and evictions, since it started: logged every 16 steps and at each
prompt's compaction as one `kvtrim: stats ...` line (read back by benchmarks/serving/report.py, fields by name)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class WorkerStats:
    #: model steps that ran tokens, and their seconds (`execute_model` + `sample_tokens`)
    steps: int = 0
    step_s: float = 0.0
    #: of those seconds, choosing and moving what to keep (the scheduler's planning of every step included)
    compaction_s: float = 0.0
    #: compactions done and entries discarded by them
    compactions: int = 0
    evicted: int = 0
    #: of `compaction_s`, the attention backend's probabilities of decode steps (`QueryTap.step_probs`; a pass that
    #: computed the layer's attention with them counts whole, although vLLM's attention did not run then)
    probs_s: float = 0.0
    #: layers' forwards whose attention kvtrim's kernel computed with the probabilities (`QueryTap.attends`), and
    #: their seconds (in `probs_s`: an upper bound of what eviction cost there, the attention itself included)
    attended: int = 0
    attended_s: float = 0.0
    #: of the compactions, those decided in a batch with other requests' (`kvtrim.vllm.live_batch`)
    batched: int = 0
    #: seconds spent giving freed heap memory back to the system (`kvtrim.vllm.memory`)
    trim_s: float = 0.0

    def line(self) -> str:
        """`kvtrim: stats steps=... step_s=... ...` (seconds to the millisecond)."""
        shown = (f"{f.name}={getattr(self, f.name):.3f}" if f.type == "float" else f"{f.name}={getattr(self, f.name)}"
                 for f in fields(self))
        return "kvtrim: stats " + " ".join(shown)

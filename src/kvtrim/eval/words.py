"""Small English word lists, written for kvtrim (RULER draws its words from the `wonderwords` package;
these lists play the same role without the dependency).

Used for needle keys (`adjective-noun`, as RULER does), the common-words task and the synthetic prose
haystack. All words are lowercase ASCII letters, no hyphens, no digits.
"""

from __future__ import annotations

NOUNS = """
acorn actor airport album alley anchor angle animal ankle answer apple apron arch arena arm army arrow
artist atlas attic aunt author autumn avenue award axle baby badge bag bakery balcony ball balloon band
bank banner barn barrel basket bath battery beach beam bean bear beard bed bee beetle bell belt bench
berry bicycle bird biscuit blade blanket block blossom boat body bone book boot border bottle boulder
bowl box branch bread brick bridge broom brother brush bucket bud buffalo building bulb bundle bush
butter button cabin cabinet cable cake calendar camel camera camp canal candle cane canoe canvas canyon
cap captain car card carpet carriage carrot cart castle cat cattle cave ceiling cellar chain chair chalk
channel chapter cheese cherry chest chicken child chimney chin church circle city clam class clay cliff
clock cloth cloud clover coach coast coat cobbler coin collar colony comet compass copper coral cord
corn corner cottage cotton couch counter country court cousin cow crab cradle crane crayon creek crew
cricket crow crown crystal cup cupboard curtain cushion dairy daisy dancer deer desert desk diamond
dinner doctor dog doll dolphin donkey door dragon drawer dream dress drum duck dune eagle ear earth
easel elbow elephant elk engine envelope eye fabric face factory falcon family farm farmer feather
fence ferry field fig finger fire fish flag flame flask fleet flower flute fog folder forest fork
fountain fox frame friend frog fruit furnace garage garden gate gear giant giraffe glacier glass globe
glove goat gold goose grape grass gravel guitar gull hall hammer hand harbor harp hat hawk hay head
hedge helmet hen herb hill hive hook horse hotel house hut island jacket jar jelly jewel journal judge
jungle kettle key king kitchen kite kitten knee knife ladder lake lamp lantern lawn leaf lemon letter
library lid lighthouse lily lion lizard lobster lock locket log loom magnet mailbox map maple marble
market mask meadow melon mill mirror mitten monkey moon moose moss moth mountain mouse mule museum
mushroom nail napkin needle nest net notebook oak oar ocean office olive onion orange orchard otter
owl ox oyster paddle page pail palace palm pan panda paper parcel park parrot path peach pear pearl
pebble pelican pen pencil pepper piano pickle picture pig pillow pilot pine pipe pirate pitcher planet
plank plate plum pocket poet pond pony porch pot potato pouch puddle pumpkin puppet puppy quail queen
quilt rabbit raft rail rain rake raven reef ribbon rice river road robin rock rocket roof room rope
rose sack saddle sail sailor salmon sand sandal satchel saucer scarf school scissors sea seal seed
shadow shark sheep shelf shell ship shirt shoe shovel shrub singer sink sister skate skirt sky sled
snail snake soap sock sofa soldier spider spoon spring square squirrel stable stage stair star station
statue stem stick stone stool storm stove straw stream street string sugar suit summer sun swan
sweater swing table tail tailor teacher teapot tent thimble thread throne thumb ticket tiger timber
toad toast tomato tongue tool tooth torch tower town toy tractor trail train tray tree trolley trumpet
trunk tulip tunnel turkey turtle twig umbrella uncle valley vase vest village violin wagon wall walnut
wand wardrobe wasp watch water wave weasel well whale wheat wheel whistle willow window wing winter
wire wizard wolf woman wood wool worm wren yard yarn zebra
""".split()

ADJECTIVES = """
able absent active afraid agile alert alive amber ample ancient angry anxious arctic ashen awake
basic bashful bitter bland blank bleak blind blond blue blunt bold bony bossy bouncy brave brief bright
brisk broad broken bronze brown bulky bumpy busy calm candid careful casual cheap cheerful chilly
chubby civil clean clear clever cloudy clumsy coarse cold common cool cosy crafty crazy creamy crisp
crooked crowded cruel curly curved damp dark dear deep dense dim dirty distant dizzy dreamy dry dull
dusty eager early earnest easy elegant empty endless equal even exact faint fair faithful false famous
fancy far fast fat fearless feeble fierce fine firm flat fluffy foggy fond formal fragile frank free
fresh friendly frozen full funny fuzzy gentle giant gifted glad gloomy golden good graceful grand
grassy grateful gray great green grumpy hairy handy happy hard harsh hasty healthy heavy helpful hidden
high hollow honest hopeful hot huge humble hungry icy idle jolly juicy keen kind large late lazy lean
light little lively lone long loose loud lovely loyal lucky lumpy mad magic major massive meek mellow
merry mighty mild minor misty modern moist narrow nasty neat nervous new nice nimble noble noisy
normal odd old open orange pale patient peaceful perfect plain playful pleasant plump polite poor
precious pretty proud purple quick quiet rapid rare ready real red rich rigid ripe rocky rough round
royal rude rusty sad safe salty sandy scarce secret shaggy shallow sharp shiny short shy silent silky
silly silver simple sleepy slim slow small smart smooth snowy soft solid sour sparse spicy splendid
spotted square stale steady steep sticky stiff still stormy strange strict strong sturdy subtle sudden
sunny super sweet swift tall tame tender thick thin thirsty tidy tight tiny tired tough tricky true
twin ugly upset urban useful vague vast velvet violet vivid warm wary weak wealthy weary wet white
whole wide wild windy wise witty wooden woolly worried yellow young zealous
""".split()

VERBS = """
accept admire adopt agree allow answer appear arrange arrive ask attach attend bake balance bathe
begin behave believe belong bless blink boast boil borrow bounce bow breathe bring brush build bump
burn bury buy calculate call carry carve catch chase check cheer chew choose clap clean climb close
collect comb compare complain count cover crack crawl cross cry cycle dance decide deliver describe
design destroy dig discover divide double drag draw dream drift drink drive drop dust earn eat embrace
enjoy enter escape examine explain explore fail fasten fetch fill find fix float flow fly fold follow
forgive gather gaze gild glow grab greet grin grow guard guess guide hammer hang harvest hatch heal
hear help hide hike hold hop hug hum hunt hurry imagine improve inform invent invite iron jog join
juggle jump keep kick kneel knit knock label land laugh launch lead learn lend lift listen load
locate look love manage march mark marry measure melt mend milk mix move nod notice obey observe
offer open order pack paddle paint park pass pause peel pick plant play pledge plow point polish
pour praise pray prefer prepare press print promise protect pull pump punch push question race rain
raise reach read receive record reflect relax remember remind repair repeat reply rescue rest return
ride ring rinse roar roll row rub rush sail save scatter scrub search sell send serve sew shake share
shine shiver shout sing sip sit sketch ski skip sleep slide smell smile sneeze snore solve sort sow
spark speak spell spin splash spray sprout squeeze stack stamp stand stare start stay steer step stir
stitch stop store stretch study suggest supply surprise swim swing talk taste teach tease thank throw
tickle tie touch trace trade train travel treat tremble trot trust try tug tumble turn twist type
unfold unlock unpack use vanish visit wait walk wander want warn wash watch water wave weave weigh
whisper whistle win wink wish wobble wonder work worry wrap write yawn yell zoom
""".split()

ADVERBS = """
quietly slowly gently quickly suddenly often rarely calmly softly boldly happily sadly warmly early
later again together nearby outside inside always sometimes never seldom easily carefully patiently
""".split()

PREPOSITIONS = "near beside behind under over across along around beyond below above toward past".split()


def third_person(verb: str) -> str:
    """`walk` -> `walks`, `watch` -> `watches`, `carry` -> `carries`."""
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def all_words() -> list[str]:
    """Every distinct word of the lists, sorted (the common-words task's vocabulary)."""
    return sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS))

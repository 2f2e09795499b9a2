"""The synthetic tasks' documents: needle's key-value facts among filler sentences, and rag's pool of needle chunks
(CacheBlend's workload). `specjax.eval.tasks` declares the two tasks and words their questions; `specjax.eval.workload`
builds requests from these documents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from specjax.eval.errors import EvalError

# A document interleaves plain filler sentences with facts "The secret code of the <adjective>
# <object> is <4-digit code>.", one sentence per line; a question repeats one fact's own words
# up to the code ("The secret code of the red door is") and the choices are codes of other facts
# of the same document, so only retrieval from the prefix tells them apart (all choices have the
# same length, so acc and acc_norm agree). Design notes, from recompute runs of a small model
# (smollm2-135m) over seeded workloads:
# - facts must read as natural text and the question must be a near-copy of the fact: the model
#   copies natural text but not lists of unrelated words; a "Question: ...? Answer: ..." wrapper
#   or one-token name keys ("The secret word of Alice is apple.") answer far less often;
# - keys whose adjective and object each occur once in the document (unique words, not merely
#   unique pairs) and numeric codes rather than word values answer clearly more often;
# - filler sentences between facts and one sentence per line help a little more, and make it a
#   needle in a haystack: about half the prefix tokens are facts, the rest can be dropped.
# Past len(adjectives) facts per document, adjectives and objects are reused in distinct pairs
# (long --prefix_tokens prefixes), which makes retrieval harder.
NEEDLE_ADJECTIVES = (
    "red", "blue", "green", "black", "white", "silver", "golden", "brown", "purple", "orange",
    "yellow", "pink", "gray", "wooden", "iron", "old", "new", "small", "big", "tall",
    "round", "heavy", "broken", "painted", "narrow", "wide", "dark", "bright", "plain", "square",
    "front", "back", "upper", "lower", "hidden", "main", "little", "long", "short", "empty",
)
NEEDLE_OBJECTS = (
    "door", "box", "gate", "room", "car", "house", "boat", "book", "chest", "lamp",
    "clock", "bag", "desk", "shelf", "bottle", "tower", "bridge", "window", "cabinet", "drawer",
    "safe", "locker", "garage", "shed", "trunk", "case", "barn", "cellar", "office", "kitchen",
    "garden", "wall", "truck", "train", "van", "table", "basket", "tent", "cart", "phone",
)
NEEDLE_FILLER = (
    "The morning was cool and the streets were still quiet.",
    "A small bakery on the corner opened its doors at seven.",
    "Children walked to school with their bags on their backs.",
    "The river ran slowly past the old stone mill.",
    "Farmers in the valley were busy bringing in the harvest.",
    "A light rain fell for most of the afternoon.",
    "The library was full of students preparing for their exams.",
    "Trains to the city left every half hour from the station.",
    "Most of the shops on the main street closed early on Sunday.",
    "A group of tourists stopped to take pictures of the bridge.",
    "The museum opened a new exhibition about ancient maps.",
    "In the park, an old man fed the pigeons with bread crumbs.",
    "The town council met on Tuesday to discuss the new road.",
    "Fresh vegetables were sold at the market every Saturday.",
    "The wind picked up in the evening and the sky grew dark.",
    "A cat slept in the sun on the steps of the post office.",
    "The football team trained on the field behind the school.",
    "Many people in the village kept chickens in their gardens.",
    "The old clock tower rang the hour across the square.",
    "A fishing boat came back to the harbor late at night.",
    "The teacher read a story to the class after lunch.",
    "Snow covered the hills for most of the winter.",
    "The hospital added a new wing for children last year.",
    "Two friends sat in the cafe and talked for hours.",
    "The road through the forest was narrow and full of turns.",
    "A new bookshop opened next to the pharmacy.",
    "The festival drew visitors from all over the region.",
    "Workers repaired the roof of the church during the summer.",
    "The lake froze early that year, and people went skating.",
    "A long line of cars waited at the border crossing.",
    "The orchestra practiced every evening in the town hall.",
    "Birds sang in the trees along the edge of the field.",
    "The bus was late again because of the heavy traffic.",
    "An old woman sold flowers from a cart near the fountain.",
    "The factory on the hill had been closed for many years.",
    "Students painted a large mural on the wall of the gym.",
    "The price of bread went up slightly in the spring.",
    "A storm knocked down several trees near the river.",
    "The neighbors held a small party to welcome the new family.",
    "Lights in the windows came on one by one as night fell.",
    "The baker's son delivered bread to the houses on the hill.",
    "A dog barked at the mail carrier every single morning.",
    "The ferry crossed the bay twice a day in good weather.",
    "Apple trees bloomed in the orchard behind the farmhouse.",
    "The mayor gave a short speech at the opening of the park.",
    "A thick fog rolled in from the sea before dawn.",
    "The children built a snowman in front of the school.",
    "Old photographs of the town hung in the hallway of the inn.",
    "The market square was crowded on the first day of summer.",
    "A young couple opened a small restaurant near the station.",
)
NEEDLE_HEADER = "Read the notes below and remember the secret codes.\n"
# The question repeats a fact's own words up to its value: the answer is a near-copy from the prefix.
NEEDLE_QUESTION = "The secret code of {key} is"


@dataclasses.dataclass(frozen=True)
class NeedleDoc:
    """One synthetic document: key -> value facts, each after its filler text; its text is a request prefix."""

    keys: tuple[str, ...]  # "the red door"
    values: tuple[str, ...]  # "4821"
    filler: tuple[str, ...] = ()  # text on the line(s) before each fact ("" for none)

    def fact(self, i: int) -> str:
        return NEEDLE_QUESTION.format(key=self.keys[i]) + f" {self.values[i]}."

    def body(self) -> str:
        """The facts, each after its filler, one sentence per line (every line ends with a newline)."""
        filler = self.filler or ("",) * len(self.keys)
        return "".join((f + "\n" if f else "") + self.fact(i) + "\n" for i, f in enumerate(filler))

    def text(self) -> str:
        return NEEDLE_HEADER + self.body() + "\n"


@dataclasses.dataclass(frozen=True)
class NeedleSpec:
    num_facts: int = 28  # default prefix ~ 790 tokens with smollm2's tokenizer (20: ~565)
    num_choices: int = 4
    values: tuple[str, ...] = ()  # word values instead of codes (retrieved worse, see above); () = codes
    names: tuple[str, ...] = NEEDLE_OBJECTS  # the objects in keys "the <adjective> <object>"
    adjectives: tuple[str, ...] = NEEDLE_ADJECTIVES
    code_digits: int = 4
    filler_per_fact: int = 1  # filler sentences before each fact
    filler: tuple[str, ...] = NEEDLE_FILLER


def single_token_words(tokenizer, words: Sequence[str], minimum: int = 20) -> tuple[str, ...]:
    """The words that are one token after a space (so a key's words cannot merge with their
    neighbours differently in the prefix and in the question); all of them if fewer than
    `minimum` are."""
    kept = tuple(w for w in words if len(tokenizer.encode(" " + w)) == 1)
    return kept if len(kept) >= minimum else tuple(words)


def needle_keys(rng: np.random.Generator, adjectives: Sequence[str], objects: Sequence[str], n: int) -> list[str]:
    """n distinct "the <adjective> <object>" keys; while n <= min(len(adjectives), len(objects)),
    every adjective and every object occurs in one key only (measured: shared words confuse
    retrieval); past that, each word is reused as evenly as possible."""
    adj = [str(a) for a in rng.permutation(adjectives)]
    obj = [str(o) for o in rng.permutation(objects)]
    a, b = len(adj), len(obj)
    if n > a * b:
        raise EvalError(f"needle: at most {a * b} facts per prefix (asked {n})")
    # round r pairs adjective i with object (i + r) mod b: distinct pairs across rounds
    if a <= b:
        pairs = [(j % a, (j % a + j // a) % b) for j in range(n)]
    else:
        pairs = [((j % b + j // b) % a, j % b) for j in range(n)]
    keys = [f"the {adj[i]} {obj[k]}" for i, k in pairs]
    return [keys[i] for i in rng.permutation(n)]


def make_needle_doc(rng: np.random.Generator, spec: NeedleSpec) -> NeedleDoc:
    n = spec.num_facts
    keys = needle_keys(rng, spec.adjectives or NEEDLE_ADJECTIVES, spec.names or NEEDLE_OBJECTS, n)
    if spec.values:
        # distinct values while they last, so the candidates of a question are different words
        values = [str(v) for v in rng.permutation(spec.values)]
        while len(values) < n:
            values += [str(v) for v in rng.permutation(spec.values)]
    else:
        low = 10 ** (spec.code_digits - 1)
        if n > 9 * low:
            raise EvalError(f"needle: at most {9 * low} facts with {spec.code_digits}-digit codes (asked {n})")
        values = [str(low + int(c)) for c in rng.choice(9 * low, n, replace=False)]
    pool = list(spec.filler or NEEDLE_FILLER)
    order = [str(pool[i]) for i in rng.permutation(len(pool))]
    k = spec.filler_per_fact
    filler = tuple(" ".join(order[(i * k + j) % len(order)] for j in range(k)) for i in range(n))
    return NeedleDoc(tuple(keys), tuple(values[:n]), filler)


def question_row(doc: NeedleDoc, i: int, rng: np.random.Generator, num_choices: int) -> dict:
    """A row asking about fact i; the distractors are other values of the same document."""
    gold_value = doc.values[i]
    others = sorted({v for v in doc.values if v != gold_value})
    picked = [str(v) for v in rng.choice(others, min(num_choices - 1, len(others)), replace=False)]
    gold = int(rng.integers(len(picked) + 1))
    return {"key": doc.keys[i], "choices": picked[:gold] + [gold_value] + picked[gold:], "gold": gold}


# ---------------------------------------------------------------- rag

# A RAG-like request: a header chunk, then several text chunks drawn from a pool in a per-context order, then
# a needle question about a fact in one of them. Each chunk is a needle document's body (facts after filler
# lines, every line ending with a newline, so chunk texts join naturally) and is tokenized on its own: the
# request's prefix is exactly the concatenation of its chunks' tokens, and each chunk's KV can be cached alone
# (computed at positions 0..len-1) and reused wherever a request places it. The pool is one needle document
# split into chunks, so keys never share a word within a request (see the needle notes above).
RAG_HEADER = NEEDLE_HEADER


@dataclasses.dataclass(frozen=True)
class RagSpec:
    pool_chunks: int = 10  # text chunks in the pool (all keys use distinct words up to 40 facts in all)
    facts_per_chunk: int = 4
    chunks_per_request: tuple[int, int] = (4, 6)  # inclusive range of retrieved chunks per context
    num_choices: int = 4


def make_rag_pool(rng: np.random.Generator, spec: RagSpec, needle: NeedleSpec) -> tuple[NeedleDoc, ...]:
    """The pool's chunks: one needle document of pool_chunks * facts_per_chunk facts, cut into chunks."""
    f = spec.facts_per_chunk
    doc = make_needle_doc(rng, dataclasses.replace(needle, num_facts=spec.pool_chunks * f))
    return tuple(NeedleDoc(doc.keys[i:i + f], doc.values[i:i + f], doc.filler[i:i + f])
                 for i in range(0, len(doc.keys), f))


def rag_row(chunks: Sequence[NeedleDoc], chunk: int, fact: int, rng: np.random.Generator, num_choices: int) -> dict:
    """A row asking about fact `fact` of chunks[chunk]; distractors are other codes of the same context."""
    merged = NeedleDoc(tuple(k for c in chunks for k in c.keys), tuple(v for c in chunks for v in c.values))
    return question_row(merged, sum(len(c.keys) for c in chunks[:chunk]) + fact, rng, num_choices)

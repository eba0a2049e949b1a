"""The workloads every subcommand sends: prompts built with the model's tokenizer, reproducible per seed.

  random                   SGLang's: random tokens, uniform input/output lengths in [len * ratio, len]
  generated-shared-prefix  SGLang's: groups of questions after a shared random system prompt
  copy                     a chat model asked to repeat a JSON document, a Python class or a numbered
                           list from its prompt: the case of prompt-lookup (n-gram) speculative decoding

Importing this module loads neither aiohttp nor transformers.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATASETS = ("random", "generated-shared-prefix", "copy")


def default_tokenizer_path() -> str:
    """The converted default model's directory (it holds tokenizer.json)."""
    src = os.path.join(ROOT, "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from relay.execution.model_files import resolve_model_dir

    return resolve_model_dir(None)


def load_tokenizer(path: str | None):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(path or default_tokenizer_path())


def candidate_ids(tokenizer) -> np.ndarray:
    """Token ids to draw random prompts from: the vocabulary without special tokens."""
    special = set(tokenizer.all_special_ids or [])
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def random_text(
    tokenizer, rng: np.random.Generator, num_tokens: int, candidates: np.ndarray
) -> tuple[str, int]:
    """Text that re-encodes to `num_tokens` tokens (as near as the tokenizer allows): random token ids are
    decoded, re-encoded, truncated or topped up, and decoded again, as SGLang's random dataset does."""
    ids = rng.choice(candidates, size=num_tokens).tolist()
    text = tokenizer.decode(ids)
    for _ in range(10):
        enc = encode(tokenizer, text)
        if len(enc) == num_tokens:
            return text, num_tokens
        enc = (
            enc[:num_tokens]
            if len(enc) > num_tokens
            else enc + rng.choice(candidates, size=num_tokens - len(enc)).tolist()
        )
        text = tokenizer.decode(enc)
    return text, len(encode(tokenizer, text))


# ------------------------------------------------------------------------------- datasets --


@dataclass
class DatasetRow:
    prompt: str
    prompt_len: int
    output_len: int
    group: int = -1  # generated-shared-prefix: which system prompt
    passage: str = ""  # copy: the text the prompt asks to have repeated


def _uniform_lens(rng: np.random.Generator, length: int, ratio: float, n: int) -> np.ndarray:
    """SGLang's semantics: uniform integers in [max(int(length * ratio), 1), length]."""
    return rng.integers(max(int(length * ratio), 1), length + 1, size=n)


def build_random_dataset(
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    input_range_ratio: float,
    output_range_ratio: float,
    seed: int,
) -> list[DatasetRow]:
    """The `random` workload: prompts of random tokens with uniform input/output lengths. The same arguments
    give the same prompts and output lengths (the hf subcommand relies on it)."""
    rng = np.random.default_rng(seed)
    input_lens = _uniform_lens(rng, input_len, input_range_ratio, num_prompts)
    output_lens = _uniform_lens(rng, output_len, output_range_ratio, num_prompts)
    candidates = candidate_ids(tokenizer)
    rows = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        text, real_len = random_text(tokenizer, rng, n_in, candidates)
        rows.append(DatasetRow(text, real_len, int(n_out)))
    return rows


def build_gsp_dataset(
    tokenizer,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[DatasetRow]:
    """SGLang's `generated-shared-prefix` workload: `num_groups` random system prompts, each followed by
    `prompts_per_group` random questions ("{system}\\n\\n{question}"); the requests are shuffled."""
    rng = np.random.default_rng(seed)
    candidates = candidate_ids(tokenizer)
    rows = []
    for g in range(num_groups):
        system, _ = random_text(tokenizer, rng, system_prompt_len, candidates)
        for _ in range(prompts_per_group):
            question, _ = random_text(tokenizer, rng, question_len, candidates)
            prompt = f"{system}\n\n{question}"
            rows.append(DatasetRow(prompt, len(encode(tokenizer, prompt)), output_len, g))
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


# `copy`: passages made from the seed with these small word lists (no download), for prompt-lookup (n-gram)
# speculative decoding, whose drafts come from text the prompt already holds.
_FIRST_NAMES = (
    "Alice",
    "Bruno",
    "Chen",
    "Dara",
    "Emil",
    "Fatima",
    "Goran",
    "Hana",
    "Ivan",
    "Jun",
    "Kofi",
    "Lena",
    "Mateo",
    "Nora",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tariq",
    "Uma",
    "Viktor",
)
_LAST_NAMES = (
    "Smith",
    "Garcia",
    "Novak",
    "Okafor",
    "Tanaka",
    "Berg",
    "Rossi",
    "Kowalski",
    "Silva",
    "Moreau",
    "Jensen",
    "Patel",
    "Nguyen",
    "Haddad",
    "Fischer",
    "Lopez",
    "Ivanova",
    "Cohen",
    "Murphy",
    "Sato",
)
_CITIES = (
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Osaka",
    "Lima",
    "Krakow",
    "Dublin",
    "Austin",
    "Hanoi",
    "Porto",
    "Quito",
    "Tunis",
    "Bergen",
    "Leeds",
    "Perth",
    "Seville",
    "Zagreb",
    "Denver",
    "Lyon",
    "Cairo",
)
_PRODUCTS = (
    "lamp",
    "chair",
    "kettle",
    "notebook",
    "backpack",
    "umbrella",
    "blanket",
    "mug",
    "clock",
    "scarf",
)
_NOUNS = (
    "garden",
    "river",
    "window",
    "engine",
    "letter",
    "market",
    "bridge",
    "lantern",
    "harbor",
    "forest",
    "ledger",
    "signal",
    "orchard",
    "kettle",
    "tower",
    "meadow",
    "carpet",
    "mirror",
    "valley",
    "basket",
)
_ADJECTIVES = (
    "quiet",
    "bright",
    "old",
    "narrow",
    "heavy",
    "green",
    "silver",
    "distant",
    "warm",
    "broken",
    "small",
    "gentle",
    "busy",
    "empty",
    "golden",
    "steep",
    "careful",
    "wooden",
    "late",
    "clear",
)
_VERBS = (
    "opened",
    "carried",
    "painted",
    "counted",
    "repaired",
    "watched",
    "cleaned",
    "moved",
    "found",
    "measured",
    "followed",
    "closed",
    "sold",
    "built",
    "visited",
    "checked",
    "lifted",
    "shared",
)
_FN_VERBS = (
    "load",
    "parse",
    "count",
    "merge",
    "scale",
    "check",
    "update",
    "build",
    "format",
    "filter",
)
_SENTENCES = (
    "{f} {l} moved to {c} in {y} and opened a small {n} shop.",
    "Every morning, {f} walks past the {a} {n} on the way to work.",
    "The {a} {n} near the station was {v} by {f} last week.",
    "In {y}, the city of {c} built a {a} {n} beside the old {n2}.",
    "{f} said the {n} was too {a} to carry, so {l} took it instead.",
    "Nobody in {c} remembers who {v} the {n} first.",
)
# The instruction per passage kind ({lines}: the passage's line count). Plain "repeat exactly" on purpose:
# SmolLM2-135M-Instruct, the default model, echoes these three kinds nearly verbatim and then stops, while
# asking it for edits (set a field, rename a class) or giving it long runs of look-alike units (a JSON array
# of same-shaped records, a paragraph of template sentences) made it drop parts or loop, and loops are
# easier to draft than copies. Naming the last number of the list is what makes it stop after the list.
_COPY_INSTRUCTIONS = {
    "json": "Repeat the following JSON document exactly. Output only the JSON document.",
    "code": "Repeat the following Python class exactly. Output only the class.",
    "list": "Repeat the following numbered list exactly, from 1 to {lines}. Output only the numbered list.",
}


def _pick(rng: np.random.Generator, words: tuple[str, ...]) -> str:
    return words[int(rng.integers(len(words)))]


def _fill(tokenizer, budget: int, make, text=str) -> list[Any]:
    """Units from `make(i)` until their token counts (each unit encoded alone, which is within a few tokens
    of encoding them together) reach `budget`, stopping at whichever side of it is nearer; at least one."""
    units: list[Any] = []
    total = 0
    while total < budget:
        unit = make(len(units))
        n = len(encode(tokenizer, text(unit)))
        if units and total + n - budget > budget - total:
            break
        units.append(unit)
        total += n
    return units


def _json_passage(rng: np.random.Generator, tokenizer, passage_len: int) -> str:
    """An order document: a customer, then line items until the passage is long enough."""
    doc: dict[str, Any] = {
        "order_id": f"A-{int(rng.integers(10000, 100000))}",
        "customer": {
            "name": f"{_pick(rng, _FIRST_NAMES)} {_pick(rng, _LAST_NAMES)}",
            "email": f"{_pick(rng, _FIRST_NAMES).lower()}@example.com",
            "city": _pick(rng, _CITIES),
        },
        "items": [],
        "paid": bool(rng.integers(2)),
        "note": f"Leave it at the {_pick(rng, _ADJECTIVES)} {_pick(rng, _NOUNS)}.",
    }
    head = len(encode(tokenizer, json.dumps(doc, indent=2)))
    doc["items"] = _fill(
        tokenizer,
        passage_len - head,
        lambda i: {
            "sku": f"{_pick(rng, _PRODUCTS)}-{int(rng.integers(100, 1000))}",
            "qty": int(rng.integers(1, 10)),
            "price": round(float(rng.uniform(2, 90)), 2),
        },
        lambda item: json.dumps(item, indent=2),
    )
    return json.dumps(doc, indent=2)


def _code_passage(rng: np.random.Generator, tokenizer, passage_len: int) -> str:
    """A Python class: a constructor, then small methods until the passage is long enough."""
    head = (
        f"class {_pick(rng, _NOUNS).capitalize()}Store:\n"
        f"    def __init__(self, path):\n"
        f"        self.path = path\n"
        f"        self.items = []\n"
    )

    def method(i: int) -> str:
        noun = _pick(rng, _NOUNS)
        return (
            f"\n    def {_pick(rng, _FN_VERBS)}_{noun}(self, {noun}_id):\n"
            f"        if {noun}_id < {int(rng.integers(2, 50))}:\n"
            f"            return None\n"
            f"        return self.items[{noun}_id % len(self.items)]\n"
        )

    return head + "".join(_fill(tokenizer, passage_len - len(encode(tokenizer, head)), method))


def _list_passage(rng: np.random.Generator, tokenizer, passage_len: int) -> str:
    """English sentences from templates, one per numbered line (the numbers keep a small model's place)."""

    def sentence(i: int) -> str:
        template = _SENTENCES[int(rng.integers(len(_SENTENCES)))]
        return f"{i + 1}. " + template.format(
            f=_pick(rng, _FIRST_NAMES),
            l=_pick(rng, _LAST_NAMES),
            c=_pick(rng, _CITIES),
            y=int(rng.integers(1950, 2025)),
            n=_pick(rng, _NOUNS),
            n2=_pick(rng, _NOUNS),
            a=_pick(rng, _ADJECTIVES),
            v=_pick(rng, _VERBS),
        )

    return "\n".join(_fill(tokenizer, passage_len, sentence))


_COPY_PASSAGES = {"json": _json_passage, "code": _code_passage, "list": _list_passage}


def _chat_prompt(tokenizer, content: str) -> str:
    """The user message in the tokenizer's chat template (the default model is a chat model, and
    /v1/completions sends raw text); the bare message if the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    return content


def build_copy_dataset(
    tokenizer, num_prompts: int, passage_len: int, output_len: int, seed: int
) -> list[DatasetRow]:
    """The `copy` workload, for prompt-lookup (n-gram) speculative decoding: each prompt asks the model to
    repeat a passage of about `passage_len` tokens (a JSON document, a Python class or a numbered list of
    sentences, the kinds taking turns), so most of a good answer is text the prompt already holds.

    `output_len` is only max_tokens: the answer ends by itself (EOS) after the passage, and a copy that
    ends is the realistic case, so this workload is meant to run without --ignore-eos (ignore_eos would
    pad every answer with whatever the model says after its copy). Output tokens, throughput and TPOT
    are counted from the tokens each request actually got (the server's usage count), so they stay right;
    but requests differ in length, so compare configurations whose outputs are the same (greedy decoding:
    a lossless speculative decoder changes no output)."""
    rng = np.random.default_rng(seed)
    kinds = list(_COPY_PASSAGES)
    rows = []
    for i in range(num_prompts):
        kind = kinds[i % len(kinds)]
        passage = _COPY_PASSAGES[kind](rng, tokenizer, passage_len)
        instruction = _COPY_INSTRUCTIONS[kind].format(lines=passage.count("\n") + 1)
        prompt = _chat_prompt(tokenizer, f"{instruction}\n\n{passage}")
        rows.append(DatasetRow(prompt, len(encode(tokenizer, prompt)), output_len, passage=passage))
    return rows


def build_dataset(args, tokenizer) -> list[DatasetRow]:
    if args.dataset_name == "random":
        ratio = args.random_range_ratio
        return build_random_dataset(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            ratio if args.random_input_range_ratio is None else args.random_input_range_ratio,
            ratio if args.random_output_range_ratio is None else args.random_output_range_ratio,
            args.seed,
        )
    if args.dataset_name == "copy":
        return build_copy_dataset(
            tokenizer, args.num_prompts, args.copy_passage_len, args.copy_output_len, args.seed
        )
    return build_gsp_dataset(
        tokenizer,
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        args.seed,
    )

"""Procedural, deterministic training text for the tiny tokenizer.

Nothing here touches the network or the filesystem: the corpus is generated
from fixed word lists with a seeded :class:`random.Random`, so the same
``(seed, target_bytes)`` always yields the same text.  The mix of prose,
chat-like turns and code-like lines lets varied prompts tokenize into a
reasonable number of tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

DEFAULT_CORPUS_BYTES = 1_500_000


def _words(text: str) -> list[str]:
    """Split a whitespace-separated word list."""
    return text.split()


_NOUNS = _words(
    "time person year way day thing man world life hand part child eye woman "
    "place work week case point government company number group problem fact "
    "system program question night home water room mother area money story "
    "month lot book word business issue side kind head house service friend "
    "father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others "
    "level office door health art war history party result change morning "
    "reason research girl guy moment air teacher force education food model "
    "cache memory server request token message network engine queue file "
    "table value function data store node cluster user client process thread "
    "river mountain garden window market picture music paper question answer"
)

_VERBS = _words(
    "is was has had does said made went took came saw knew got gave found "
    "thought told became showed left felt put brought began kept held wrote "
    "stood heard let meant set met ran paid sat spoke lay led read grew lost "
    "fell sent built understood drew broke spent cut rose drove bought wore "
    "chose sends stores loads reads writes returns computes moves pushes "
    "pulls starts stops runs opens closes checks builds tests measures"
)

_ADJECTIVES = _words(
    "good new first last long great little own other old right big high "
    "different small large next early young important few public bad same "
    "able local fast slow simple clear full special easy strong free true "
    "whole real best better hard certain recent open low short single "
    "tiny warm cold quiet bright dark empty heavy light quick careful"
)

_ADVERBS = _words(
    "quickly slowly often never always really still already almost soon "
    "together again later today maybe probably finally simply clearly"
)

_PREPOSITIONS = _words(
    "in on at by for with from about into over after under between through "
    "during before behind across near"
)

_DETERMINERS = _words("the a this that every some each our their my your its")

_NAMES = _words(
    "Alice Bob Carol David Emma Frank Grace Henry Iris Jack Kate Liam Maria "
    "Noah Olivia Paul Quinn Rosa Sam Tara Victor Wendy"
)

_CONJUNCTIONS = _words("and but so because while although when if")

_QUESTION_WORDS = _words("What Why How When Where Which Who")

_CODE_NAMES = _words(
    "value result items count index buffer offset cache request response "
    "config data key node total name size path blocks tokens handle"
)

_TYPES = _words("int str float bool list dict bytes None")

_MODULES = _words("os sys json time math random pathlib typing asyncio logging")

_SYLLABLES = _words(
    "ka lo mi ra ven tor sel an dri mu pa zen qui bel or tha lun es vor "
    "nik sa rel dom fi gar hel ist jo kor lem nar obe pri sto tu ul wyn "
    "xa yel zor bra cle dun fen gri"
)

_SUFFIXES = ("s", "s", "ing", "ed", "er", "ly", "ness", "able", "ion", "ment")

_PREFIXES = ("un", "re", "pre", "over", "under", "non", "multi", "sub")


def _pseudo_word(rng: random.Random) -> str:
    """Return a pronounceable made-up word built from two to four syllables."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _proper_name(rng: random.Random) -> str:
    """Return a person's name or a capitalised made-up place name."""
    if rng.random() < 0.6:
        return rng.choice(_NAMES)
    return _pseudo_word(rng).capitalize()


def _word(rng: random.Random, pool: list[str]) -> str:
    """Return a word from ``pool``, sometimes with an affix attached."""
    word = rng.choice(pool)
    roll = rng.random()
    if roll < 0.2:
        word += rng.choice(_SUFFIXES)
    elif roll < 0.27:
        word = rng.choice(_PREFIXES) + word
    return word


def _noun_phrase(rng: random.Random) -> str:
    """Return a short noun phrase such as ``the quiet river``."""
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.5:
        words.append(_word(rng, _ADJECTIVES))
    words.append(_word(rng, _NOUNS) if rng.random() < 0.9 else _pseudo_word(rng))
    return " ".join(words)


def _number(rng: random.Random) -> str:
    """Return a number in one of several common formats."""
    kind = rng.randrange(6)
    if kind == 0:
        return str(rng.randint(0, 100))
    if kind == 1:
        return f"{rng.randint(0, 99_999):,}"
    if kind == 2:
        return f"{rng.random() * 1000:.{rng.randint(1, 3)}f}"
    if kind == 3:
        year, month, day = (
            rng.randint(1990, 2030),
            rng.randint(1, 12),
            rng.randint(1, 28),
        )
        return f"{year}-{month:02d}-{day:02d}"
    if kind == 4:
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    return f"0x{rng.randrange(1 << 16):04x}"


def _identifier(rng: random.Random) -> str:
    """Return a snake_case, camelCase or CONSTANT_CASE identifier."""
    first, second = rng.choice(_CODE_NAMES), rng.choice(_CODE_NAMES + _NOUNS)
    style = rng.randrange(3)
    if style == 0:
        return f"{first}_{second}"
    if style == 1:
        return first + second.capitalize()
    return f"{first}_{second}".upper()


def _clause(rng: random.Random) -> str:
    """Return a simple subject-verb-object clause."""
    subject = _proper_name(rng) if rng.random() < 0.3 else _noun_phrase(rng)
    parts = [subject, _word(rng, _VERBS), _noun_phrase(rng)]
    if rng.random() < 0.4:
        parts += [rng.choice(_PREPOSITIONS), _noun_phrase(rng)]
    if rng.random() < 0.25:
        parts.append(rng.choice(_ADVERBS))
    if rng.random() < 0.15:
        parts += [rng.choice(["in", "at", "by", "near"]), _number(rng)]
    return " ".join(parts)


def _sentence(rng: random.Random) -> str:
    """Return a capitalised declarative or interrogative sentence."""
    roll = rng.random()
    if roll < 0.15:
        aux = rng.choice(["does", "did", "can"])
        body = f"{rng.choice(_QUESTION_WORDS)} {aux} {_clause(rng)}"
        return body[0].upper() + body[1:] + "?"
    text = _clause(rng)
    if roll < 0.45:
        text += f", {rng.choice(_CONJUNCTIONS)} {_clause(rng)}"
    if roll > 0.95:
        text += f" ({rng.randint(0, 999)} of {rng.randint(1000, 9999)})"
    end = "!" if rng.random() < 0.05 else "."
    return text[0].upper() + text[1:] + end


def _paragraph(rng: random.Random) -> str:
    """Return a paragraph of two to six sentences."""
    return " ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))


def _chat(rng: random.Random) -> str:
    """Return a short user/assistant exchange."""
    question = _sentence(rng).rstrip(".!?") + "?"
    lines = [f"User: {question}", f"Assistant: {_paragraph(rng)}"]
    if rng.random() < 0.3:
        lines.append(f"User: Thanks, {_proper_name(rng)}. {_sentence(rng)}")
    return "\n".join(lines)


def _code(rng: random.Random) -> str:
    """Return a small Python-like function definition."""
    name = f"{rng.choice(_VERBS)}_{_identifier(rng).lower()}"
    arg = _identifier(rng)
    ret = rng.choice(_TYPES)
    var = _identifier(rng)
    lines = [
        f"import {rng.choice(_MODULES)}",
        "",
        f"def {name}({arg}: {rng.choice(_TYPES)}) -> {ret}:",
        f'    """{_sentence(rng)}"""',
        f"    {var} = {arg} * {rng.randint(0, 255)} + {rng.randint(0, 9)}",
        f"    for i in range(len({arg})):",
        f"        if {var}[i] >= {rng.randint(1, 64)}:",
        f"            {var}[i] -= 1  # {_clause(rng)}",
        f"    return {var}",
    ]
    return "\n".join(lines)


def _record(rng: random.Random) -> str:
    """Return a JSON-like data line with numbers and identifiers."""
    key, other = _identifier(rng), rng.choice(_CODE_NAMES)
    flag = rng.choice(["true", "false", "null"])
    count = rng.randint(0, 100_000)
    return f'{{"{key}": "{_number(rng)}", "{other}": {count}, "ok": {flag}}}'


_GENERATORS: tuple[tuple[float, Callable[[random.Random], str]], ...] = (
    (0.55, _paragraph),
    (0.2, _chat),
    (0.15, _code),
    (0.1, _record),
)


def iter_documents(
    seed: int, target_bytes: int = DEFAULT_CORPUS_BYTES
) -> Iterator[str]:
    """Yield documents until about ``target_bytes`` UTF-8 bytes were produced.

    Args:
        seed: Seed for the private :class:`random.Random` instance.
        target_bytes: Approximate total size of the yielded text.

    Raises:
        ValueError: If ``target_bytes`` is not positive.
    """
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be a positive int, got {target_bytes}")
    rng = random.Random(seed)
    weights = [w for w, _ in _GENERATORS]
    makers = [m for _, m in _GENERATORS]
    produced = 0
    while produced < target_bytes:
        doc = rng.choices(makers, weights=weights)[0](rng)
        produced += len(doc.encode("utf-8")) + 1
        yield doc


def make_corpus(seed: int, target_bytes: int = DEFAULT_CORPUS_BYTES) -> list[str]:
    """Return the corpus as a list of documents (see :func:`iter_documents`)."""
    return list(iter_documents(seed, target_bytes))

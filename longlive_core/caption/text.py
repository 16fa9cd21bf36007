"""The caption's text: prompts from the template files, the cut at the bound, density, subjects.

Templates are ``string.Template`` files in configs/caption/ (``$max_new_tokens``, ``$context``,
``$captions``); their bytes are part of every caption's cache key (``template_digest``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from string import Template

from longlive_core.tracking.lineage import digest_lines

TEMPLATES = Path(__file__).resolve().parents[2] / "configs/caption"
PROMPT, CONTEXT, SUBJECTS = "prompt.txt", "context.txt", "subjects.txt"


def read_template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def prompt_words() -> str:
    """The text of every prompt template: the words the tiny model's tokenizer must know."""
    return " ".join(read_template(p.name) for p in sorted(TEMPLATES.glob("*.txt")))


def template_digest() -> str:
    """Every file of the template folder (the tiny model's chat template included), names and bytes."""
    files = sorted(p for p in TEMPLATES.iterdir() if p.is_file())
    return digest_lines(f"{p.name}\t{p.read_text(encoding='utf-8')!r}" for p in files)


def numbered(captions: list[str]) -> str:
    return "\n".join(f"{i}. {c}" for i, c in enumerate(captions, 1))


def shot_prompt(earlier: list[str], max_new_tokens: int) -> str:
    """The request for one shot, with the video's earlier captions (in order) as context."""
    context = Template(read_template(CONTEXT)).substitute(captions=numbered(earlier)) if earlier else ""
    return Template(read_template(PROMPT)).substitute(max_new_tokens=max_new_tokens, context=context).strip()


def subjects_prompt(captions: list[str]) -> str:
    return Template(read_template(SUBJECTS)).substitute(captions=numbered(captions)).strip()


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|$)")


def cut_at_sentence_end(text: str) -> str:
    """Text that reached the token bound, up to its last sentence end (all of it when it has none)."""
    ends = list(_SENTENCE_END.finditer(text))
    return text[:ends[-1].end()].strip() if ends else text.strip()


# Caption density's noun phrases, by a heuristic with no tagger: a phrase starts at a determiner or a
# number word and runs over at most three more words, up to punctuation or a function word, or up to a word
# ending in -s after the phrase's first word (taken as a present-tense verb: "a dog runs", the captions'
# style); distinct phrases (lower case) are counted. It undercounts bare plurals and names and cuts a
# phrase such as "the red dogs" short, the same way for every caption: a measure to compare, not a parse.
DETERMINERS = frozenset([
    "a", "an", "the", "this", "that", "these", "those", "his", "her", "its", "their", "one", "two", "three", "several",
    "some", "many"
])
FUNCTION_WORDS = frozenset([
    "and", "or", "but", "while", "then", "is", "are", "was", "were", "be", "being", "as", "of", "in", "on", "at", "to",
    "with", "by", "from", "into", "onto", "along", "across", "behind", "near", "over", "under", "through", "toward",
    "towards", "it", "they", "he", "she", "who", "which", "that"
])


def noun_phrases(caption: str) -> set[str]:
    words = re.findall(r"[A-Za-z][A-Za-z'-]*|[.,;:!?()]", caption.lower())
    out: set[str] = set()
    for i, w in enumerate(words):
        if w not in DETERMINERS:
            continue
        phrase = []
        for nxt in words[i + 1:i + 4]:
            if not nxt[0].isalpha() or nxt in FUNCTION_WORDS or nxt in DETERMINERS or (phrase and nxt.endswith("s")):
                break
            phrase.append(nxt)
        if phrase:
            out.add(" ".join([w, *phrase]))
    return out


def parse_subjects(text: str) -> list[str] | None:
    """The JSON array of subject names in the model's answer; None when there is no such array."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end <= start:
        return None
    try:
        value = json.loads(text[start:end + 1])
    except ValueError:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None
    return list(dict.fromkeys(v.strip() for v in value if v.strip()))


def subjects_json(subjects: list[str] | None) -> str:
    return json.dumps(subjects)

"""Whether the agent answers in the caller's language and stays in it, from ``vocable test
--json`` reports of the callers in ``benchmarks/language/`` (or any scenarios).

Each caller line and each answer gets a language by its function words (English, Spanish,
German, French: the words below, which the four do not share), or a script other than Latin
(Cyrillic, CJK...: a small model drifting away). An answer is in the caller's language when it
is in the language of the caller's line it answers; the greeting, before the caller said
anything, is not counted. Run: ``python -m benchmarks.language_staying REPORT.json...``.
"""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["language_of", "tally"]

_FUNCTION_WORDS = {
    "en": "the you your is are we i to and for of it this what when how can would please "
    "thank yes with have will our my be at on in an",
    "es": "el los las es son usted su sus de del que qué y para por con una sí está "
    "están quiere puedo gracias nombre mesa pedido hola muy señor",
    "de": "der die das ist sind sie ihr ihre ich wir und für mit ein eine einen ja nicht "
    "bitte danke möchte kann haben auf wie",
    "fr": "le les est sont vous votre vos je nous et pour avec une oui pas merci "
    "voulez pouvez bonjour bonsoir au aux du très ce",
}
_WORDS = {code: frozenset(words.split()) for code, words in _FUNCTION_WORDS.items()}
assert not any(_WORDS[a] & _WORDS[b] for a in _WORDS for b in _WORDS if a < b), (
    "a function word counts for one language only"
)
_TOKEN = re.compile(r"[^\W\d_]+")


def language_of(text: str) -> str:
    """``en``, ``es``, ``de`` or ``fr`` by the most function words; ``other script`` when most
    letters are not Latin; ``unknown`` when no language leads (a number, a name)."""
    letters = [char for char in text if char.isalpha()]
    latin = sum(unicodedata.name(char, "").startswith("LATIN") for char in letters)
    if letters and latin < len(letters) / 2:
        return "other script"
    tokens = [token.lower() for token in _TOKEN.findall(text)]
    counts = Counter({code: sum(t in words for t in tokens) for code, words in _WORDS.items()})
    ranked = counts.most_common(2)
    if not ranked or ranked[0][1] == 0 or (len(ranked) > 1 and ranked[0][1] == ranked[1][1]):
        return "unknown"
    return ranked[0][0]


def tally(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per caller language: answers in it, in another language (which), and unknown; runs
    whose every classified answer was in the caller's language."""
    by_caller: dict[str, Counter[str]] = {}
    runs: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    examples: list[str] = []
    for report in reports:
        for run in report["runs"]:
            caller = None
            stayed = True
            for turn in run["turns"]:
                said = language_of(turn.get("understood") or "")
                if said != "unknown":
                    caller = said
                answer = turn.get("answer") or ""
                if caller is None or not answer:
                    continue
                heard = language_of(answer)
                by_caller.setdefault(caller, Counter())[heard] += 1
                if heard not in (caller, "unknown"):
                    stayed = False
                    if len(examples) < 12:
                        examples.append(f"[{caller} caller, answer in {heard}] {answer[:90]}")
            if caller is not None:
                runs[caller] += 1
                kept[caller] += stayed
    return {
        "answers": {code: dict(counts) for code, counts in sorted(by_caller.items())},
        "runs_all_in_callers_language": {code: [kept[code], runs[code]] for code in sorted(runs)},
        "examples": examples,
    }


def main(paths: list[str]) -> None:
    result = tally([json.loads(Path(path).read_text()) for path in paths])
    print("| caller | answers in the caller's language | in another | unknown | runs all in it |")
    print("|---|---|---|---|---|")
    for code, counts in result["answers"].items():
        total = sum(counts.values())
        other = {k: v for k, v in counts.items() if k not in (code, "unknown")}
        kept, runs = result["runs_all_in_callers_language"][code]
        print(
            f"| {code} | {counts.get(code, 0)} of {total} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(other.items())) or 0} | "
            f"{counts.get('unknown', 0)} | {kept} of {runs} |"
        )
    for line in result["examples"]:
        print("-", line)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Export the Debian text packages bible-kjv, sword-text-web and fortunes to plain-text files.

The collapse probes need more prose than installs from the package index (5M tokens at BPE 512);
these three packages add 5.9M from apt, offline. One document per Bible chapter and per fortune,
separated by blank lines, which is what a `{kind: files, split: paragraph}` source reads.

    apt-get install bible-kjv sword-text-web diatheke fortunes
    python envs/debian_texts.py extra_corpus
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

FORTUNES_DIR = Path("/usr/share/games/fortunes")
APT_PACKAGES = "bible-kjv sword-text-web diatheke fortunes"
# `bible` prints "Ge1:1 text"; `diatheke` prints "Genesis 1:1: text" and the module name at the end.
KJV_VERSE = re.compile(r"^(?P<book>\S+?)(?P<chapter>\d+):\d+ (?P<text>.*)$")
WEB_VERSE = re.compile(r"^(?P<book>.+?) (?P<chapter>\d+):\d+: (?P<text>.*)$")


def chapters(lines: list[str], verse: re.Pattern[str]) -> list[str]:
    """Group verses into one document per chapter, in order."""
    documents: list[list[str]] = []
    current = None
    for line in lines:
        match = verse.match(line)
        if match is None or not match["text"].strip():
            continue
        key = (match["book"], match["chapter"])
        if key != current:
            documents.append([])
            current = key
        documents[-1].append(match["text"].strip())
    return ["\n".join(document) for document in documents]


def fortunes(directory: Path) -> list[str]:
    """Every fortune of the plain-text databases (those with a .dat index beside them)."""
    documents = []
    for path in sorted(directory.glob("*.dat")):
        text = path.with_suffix("").read_text(encoding="utf-8", errors="replace")
        for fortune in text.split("\n%\n"):
            lines = [line.strip() for line in fortune.strip("%").splitlines()]
            fortune = "\n".join(line for line in lines if line)
            if fortune:
                documents.append(fortune)
    return documents


def run(command: list[str]) -> list[str]:
    try:
        return subprocess.run(
            command, check=True, capture_output=True, text=True
        ).stdout.splitlines()
    except FileNotFoundError as error:
        raise SystemExit(
            f"{command[0]} is not installed: apt-get install {APT_PACKAGES}"
        ) from error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory for kjv.txt, web.txt and fortunes.txt")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    texts = {
        "kjv": chapters(run(["bible", "-f", "gen1:1-rev22:21"]), KJV_VERSE),
        "web": chapters(
            run(["diatheke", "-b", "engWEB2015eb", "-f", "plain", "-k", "Gen 1:1-Rev 22:21"]),
            WEB_VERSE,
        ),
        "fortunes": fortunes(FORTUNES_DIR),
    }
    for name, documents in texts.items():
        path = out / f"{name}.txt"
        path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
        print(f"{path}: {len(documents)} documents, {path.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()

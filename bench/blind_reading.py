#!/usr/bin/env python3
"""Scores the blind reading of the corpus's test split against its labels and
against the classifier.

    build/bin/diagnosis_bench --json=/tmp/diag.json --dump=/tmp/reports.jsonl
    scripts/python bench/blind_reading.py --dump /tmp/reports.jsonl --diagnosis /tmp/diag.json

tests/kb/testdata/corpus/blind-reading.tsv holds, for every report of the
test split as of its date, the pattern a reader chose without seeing its
label, under three conditions: `text` (only the text a user would paste, no
address, no resolution: what the classifier reads), `resolution` (the
resolution sentence too: how well the labels follow from what fixed each
failure) and `text2` (another reader of the text alone: how far two readers
agree). The corpus README says how the reading was done.

What it answers: is issue 25's 80% above what the text allows (the labels'
own noise, or reports that do not say), or is it the classifier's reading?
With --diagnosis it sets the reader beside the classifier on the same
reports. --check only verifies the file (every address in the corpus's test
split, once per condition, the same reports under each, a pattern some
record is labelled with, a confidence in [0, 1]) and exits 1 with what is
wrong. The reading covers the test split as it was on its date; reports added
to the split later are not in it, and the classifier is scored here on the
reports read.
"""
import argparse
import collections
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CORPUS = os.path.join(ROOT, "tests", "kb", "testdata", "corpus")
CONDITIONS = ("text", "resolution", "text2")
NAMES = {"text": "reader, text only", "resolution": "reader, text and resolution",
         "text2": "second reader, text only"}


def corpus_reports(dump):
    """{source: (label, split)} of the corpus reports in a diagnosis_bench --dump file: the
    records as tests/kb/dev_set.h reads them, split by repository as it splits them."""
    out = {}
    with open(dump, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r["set"] == "corpus":
                    out[r["source"]] = (r["label"], r["split"])
    return out


def read_reading(path):
    """{condition: {source: (pattern, confidence)}} and the problems found."""
    out = {c: {} for c in CONDITIONS}
    problems = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 4:
                problems.append(f"{path}:{n}: {len(parts)} fields, expected source, condition, pattern, confidence")
                continue
            source, cond, pattern, conf = parts
            if cond not in out:
                problems.append(f"{path}:{n}: condition {cond!r} is not one of {', '.join(CONDITIONS)}")
                continue
            try:
                c = float(conf)
            except ValueError:
                c = -1.0
            if not 0.0 <= c <= 1.0:
                problems.append(f"{path}:{n}: confidence {conf!r} is not a number in [0, 1]")
                continue
            if source in out[cond]:
                problems.append(f"{path}:{n}: {source} read twice under {cond}")
            out[cond][source] = (pattern, c)
    return out, problems


def check(reading, reports):
    problems = []
    test = {s for s, (_, split) in reports.items() if split == "test"}
    patterns = {label for label, _ in reports.values()}
    for cond, answers in reading.items():
        for s, (p, _) in sorted(answers.items()):
            if s not in reports:
                problems.append(f"{cond}: {s} is not a corpus record")
            elif s not in test:
                problems.append(f"{cond}: {s} is in the {reports[s][1]} split, not test")
            if p not in patterns:
                problems.append(f"{cond}: {s}: {p!r} is not a pattern any record is labelled with")
    for cond in CONDITIONS[1:]:
        if reading[cond] and set(reading[cond]) != set(reading["text"]):
            problems.append(f"{cond} read other reports than text")
    return problems


def pct(a, b):
    return f"{a}/{b} ({100.0 * a / b:.1f}%)" if b else "0/0"


def report(reading, labels, diagnosis=None):
    lines = ["| reader | reports | right | at confidence ≥ 0.8 | wrong at ≥ 0.8 |", "|---|---:|---:|---:|---:|"]
    for cond in CONDITIONS:
        a = reading[cond]
        if not a:
            continue
        right = sum(p == labels[s] for s, (p, _) in a.items())
        hi = [p == labels[s] for s, (p, c) in a.items() if c >= 0.8]
        lines.append(f"| {NAMES[cond]} | {len(a)} | {pct(right, len(a))} | {len(hi)} | {len(hi) - sum(hi)} |")
    first, second = reading["text"], reading["text2"]
    agreement = []
    if second:
        same = [s for s in first if first[s][0] == second[s][0]]
        agreement = ["", f"The two text-only readers chose the same pattern for {pct(len(same), len(first))} of "
                     f"the reports; where they agree, {pct(sum(first[s][0] == labels[s] for s in same), len(same))} "
                     f"match the label."]
    if diagnosis is None:
        return "\n".join(lines + agreement)
    # The classifier on the same reports (the test split may have grown since the reading).
    wrong = {w["source"]: w for w in diagnosis["corpus"]["wrong"]}
    a = reading["text"]
    right = sum(s not in wrong for s in a)
    confident_wrong = sum(s in wrong and wrong[s]["confidence"] >= 0.8 for s in a)
    lines.append(f"| classifier | {len(a)} | {pct(right, len(a))} | – | {confident_wrong} |")
    lines += agreement
    cells = collections.Counter()
    reader_only = collections.Counter()
    for s, (p, _) in a.items():
        rr, cr = p == labels[s], s not in wrong
        cells[(rr, cr)] += 1
        if rr and not cr:
            reader_only[(labels[s], wrong[s]["answer"])] += 1
    lines += ["", "On the same reports (reader: text only):", "",
              "| | classifier right | classifier wrong |", "|---|---:|---:|",
              f"| reader right | {cells[(True, True)]} | {cells[(True, False)]} |",
              f"| reader wrong | {cells[(False, True)]} | {cells[(False, False)]} |", "",
              "Where the reader is right and the classifier wrong (label → the classifier's answer): " +
              ", ".join(f"{lab} → {ans} {n}" for (lab, ans), n in reader_only.most_common(8)) + "."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reading", default=os.path.join(CORPUS, "blind-reading.tsv"))
    ap.add_argument("--dump", required=True, help="diagnosis_bench --dump output: every corpus report's "
                    "label and split")
    ap.add_argument("--diagnosis", help="diagnosis_bench --json output: the classifier beside the reader")
    ap.add_argument("--check", action="store_true", help="verify the reading file only")
    a = ap.parse_args()
    try:
        reports = corpus_reports(a.dump)
        reading, problems = read_reading(a.reading)
    except OSError as e:
        print(f"cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    except (json.JSONDecodeError, KeyError) as e:
        print(f"{a.dump} is not a diagnosis_bench --dump file: {e}", file=sys.stderr)
        return 1
    if not reports:
        print(f"no corpus reports in {a.dump}", file=sys.stderr)
        return 1
    labels = {s: label for s, (label, _) in reports.items()}
    problems += check(reading, reports)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    if a.check:
        test = sum(split == "test" for _, split in reports.values())
        print(f"{a.reading}: {sum(len(v) for v in reading.values())} readings of "
              f"{len(reading['text'])} of the {test} test reports, all valid")
        return 0
    diagnosis = None
    if a.diagnosis:
        with open(a.diagnosis, encoding="utf-8") as f:
            diagnosis = json.load(f)
    print(report(reading, labels, diagnosis))
    return 0


if __name__ == "__main__":
    sys.exit(main())

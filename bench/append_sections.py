#!/usr/bin/env python3
"""Appends the step-protocol, knowledge-base, browser-listing, checkpoint and TrainStep sections to
bench/RESULTS.md (after make_report.py wrote the guard and controller ones).

Every figure comes from a file the benchmarks wrote in this run. The diagnosis
section (--diagnosis) also quotes the held-out batches' first-contact figures,
which are history, from the table in tests/kb/testdata/reports/README.md."""
import argparse
import json
import os
import re


def gbench(path):
    """Google Benchmark JSON -> {name: benchmark} (aggregates dropped)."""
    if not path or not os.path.exists(path):
        return {}
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        out[b["name"]] = b
    return out


def json_lines(path):
    if not path or not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def pct(right, total):
    """right/total in percent; 0 for an empty set."""
    return 100.0 * right / total if total else 0.0


def ms(b):
    unit = b.get("time_unit", "ns")
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    return b["real_time"] * scale


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "an unnamed CPU"


def first_contact(readme):
    """{batch: (right, reports)} from the README's first-contact table."""
    out = {}
    if not readme or not os.path.exists(readme):
        return out
    for line in open(readme):
        m = re.match(r"\|\s*(held-out \d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|", line)
        if m:
            out[m.group(1)] = (int(m.group(3)), int(m.group(2)))
    return out


def abbreviations(names):
    """Short column heads for the confusion table: initials of the words."""
    out = {}
    for n in names:
        if n == "unknown":
            ab = "unk"
        elif n.startswith("("):
            ab = "none"
        else:
            words = n.split("_")
            ab = "".join(x[0] for x in words).upper() if len(words) > 1 else n[:2].upper()
        base, k = ab, 2
        while ab in out.values():
            ab, k = f"{base}{k}", k + 1
        out[n] = ab
    return out


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus_first_contact(readme):
    """The corpus README's first-contact rows: (batch, reports, right text, date, classifier)."""
    rows = []
    if not os.path.exists(readme):
        return rows
    for line in open(readme, encoding="utf-8"):
        m = re.match(r"\|\s*(batch-\d+)\s*\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|", line)
        if m:
            rows.append(m.groups())
    return rows


def corpus_part(c, fc):
    md = []
    w = md.append
    w("### The corpus labelled from resolutions (issue 25)")
    w("")
    w("tests/kb/testdata/corpus: public issue threads labelled from what fixed them, split by repository")
    w("(no repository in two splits). The text model trains on the train split (with the development set's")
    w("train split); cross-validation on train and the validation split choose its settings, its confidence is")
    w("calibrated on validation and the train split's out-of-fold answers; the test split is only scored.")
    w("")
    w("| split | reports | right | OOM found | wrong at confidence ≥ 0.8 |")
    w("|---|---:|---:|---:|---:|")
    for name in ("train", "validation", "test"):
        sc = c["by_split"].get(name)
        if not sc:
            continue
        w(f"| {name} | {sc['total']} | {sc['right']} ({pct(sc['right'], sc['total']):.1f}%) | {sc['found']} | "
          f"{sc['confident_wrong']} of {sc['confident']} |")
    w("")
    if fc:
        w("First contact: each batch scored before anything was tuned on it (from the corpus README):")
        w("")
        w("| batch | reports | right at first contact | date | classifier it met | right now |")
        w("|---|---:|---:|---|---|---:|")
        for batch, n, first, date, cls in fc:
            now = c["by_batch"].get(batch, {})
            w(f"| {batch} | {n} | {first} | {date} | {cls} | {now.get('right', '')}/{now.get('total', '')} |")
        w("")
    if c.get("test_confusion"):
        w("Confusion on the test split (rows: label; columns: answer):")
        w("")
        md.extend(confusion_table(c["test_confusion"]))
        w("")
    return md


def confusion_table(confusion):
    """Rows: label; columns: the classifier's answer; diagonal in bold."""
    md = []
    labels = sorted(confusion)
    answers = sorted({a for row in confusion.values() for a in row})
    ab = abbreviations(sorted(set(labels) | set(answers)))
    md.append("| label | n | " + " | ".join(ab[a] for a in answers) + " |")
    md.append("|---|---:|" + "---:|" * len(answers))
    for l in labels:
        row = confusion[l]
        cells = []
        for a in answers:
            v = row.get(a, 0)
            cells.append(f"**{v}**" if a == l and v else (str(v) if v else ""))
        md.append(f"| {l} ({ab[l]}) | {sum(row.values())} | " + " | ".join(cells) + " |")
    return md


def corpus_targets(c, fc, kb):
    """Issue 25's targets from the figures of this run: the corpus, its test
    split, the newest batch's first contact (from the corpus README) and,
    when kb_bench ran, BM_Classify."""
    md = []
    w = md.append
    total = sum(b["total"] for b in c["by_batch"].values())
    found = sum(b["found"] for b in c["by_batch"].values())
    test = c["by_split"].get("test", {"right": 0, "total": 0, "confident": 0, "confident_wrong": 0})
    confident = sum(sc["confident"] for sc in c["by_split"].values())

    def met(ok):
        return "met" if ok else "not met"

    w("Issue 25's targets, as measured in this run:")
    w("")
    w("| target | measured | |")
    w("|---|---|---|")
    w(f"| ≥ 400 labelled reports | {total} in {len(c['by_batch'])} batches | {met(total >= 400)} |")
    tp = pct(test["right"], test["total"])
    w(f"| test split ≥ 80% | {test['right']}/{test['total']} ({tp:.1f}%) | {met(tp >= 80)} |")
    if fc:
        batch, n, first = fc[-1][0], fc[-1][1], fc[-1][2]
        m = re.match(r"(\d+)", first)
        fp = pct(int(m.group(1)), int(n)) if m else 0.0
        got = f"{m.group(1)}/{n} ({fp:.0f}%)" if m else first
        w(f"| first contact on the newest batch ≥ 75% | {batch}: {got} | {met(fp >= 75)} |")
    cw = test["confident_wrong"]
    vacuous = " (no answer reached 0.8)" if confident == 0 else ""
    w(f"| wrong at confidence ≥ 0.8 ≤ 3% of the test split | {cw} of {test['total']}{vacuous} | "
      f"{met(cw <= 0.03 * test['total'])} |")
    w(f"| an OOM found in every corpus report | {found}/{total} | {met(found == total)} |")
    if kb and "BM_Classify" in kb:
        b = kb["BM_Classify"]
        us = ms(b) * 1000.0
        w(f"| BM_Classify < 100 µs | {us:.1f} µs | {met(us < 100)} |")
    w("")
    return md


def diagnosis_section(d, fc, kb=None):
    md = []
    w = md.append
    n, right = d["reports"], d["right"]
    w("## Diagnosis on real OOM reports")
    w("")
    w(f"`diagnosis_bench` runs the log importer and the classifier over the {n} public OOM reports of")
    w("tests/kb/testdata/reports (issue threads and Q&A pages, each quoted with its address and labelled")
    w("by hand from the report alone; `unknown` where the report does not decide). A report's answer is")
    w("its most confident OOM event, as `oomguard diagnose` lists it.")
    w("")
    w(f"- right: **{right}/{n} ({100.0 * right / n:.1f}%)**; target ≥ 85%")
    w(f"- most confident wrong answer: **{d['max_wrong_confidence']:.2f}**; target: none ≥ 0.8")
    w(f"- cost: {d['us_per_report']:.0f} µs per report (mean {d['mean_report_bytes']} bytes; parse + classify, "
      f"mean of {d['passes']} passes) on {cpu_name()} ({os.cpu_count()} cores, shared; no GPU used)")
    w("")
    w("| batch | reports | right now | right at first contact |")
    w("|---|---:|---:|---:|")
    fc_right = fc_total = 0
    for batch, bt in d["by_batch"].items():
        first = ""
        if batch in fc:
            r, t = fc[batch]
            first = f"{r}/{t} ({100.0 * r / t:.0f}%)"
            fc_right, fc_total = fc_right + r, fc_total + t
        w(f"| {batch} | {bt['total']} | {bt['right']} | {first or '(rules written on it)'} |")
    if fc_total:
        w(f"| all held-out batches | {fc_total} | | {fc_right}/{fc_total} ({100.0 * fc_right / fc_total:.0f}%) |")
    w("")
    w("The development set is not an evaluation: every batch was fed back into the rules. The first-contact")
    w("column is the better estimate of accuracy on reports the rules have not seen, and it is far lower;")
    w("what each batch's misses had in common is in the commit that follows it.")
    w("")
    w("Confusion (rows: label; columns: the classifier's answer; diagonal in bold):")
    w("")
    md.extend(confusion_table(d["confusion"]))
    w("")
    if d["wrong"]:
        w("Wrong answers:")
        w("")
        w("| report | label | answer | confidence |")
        w("|---|---|---|---:|")
        for x in d["wrong"]:
            w(f"| [{x['file']}]({x['source']}) | {x['label']} | {x['answer']} | {x['confidence']:.2f} |")
        w("")
    if d.get("corpus"):
        corpus_fc = corpus_first_contact(os.path.join(ROOT, "tests/kb/testdata/corpus/README.md"))
        md.extend(corpus_part(d["corpus"], corpus_fc))
        md.extend(corpus_targets(d["corpus"], corpus_fc, kb))
    if d.get("logs"):
        w("Raw logs (tests/kb/testdata/logs), as `oomguard diagnose` reads them:")
        w("")
        w("| log | bytes | OOM events: patterns | µs |")
        w("|---|---:|---|---:|")
        for l in d["logs"]:
            pats = l["error"] or ", ".join(l["patterns"])
            w(f"| {l['file']} | {l['bytes']} | {len(l['patterns'])}: {pats} | {l['us']:.0f} |")
        w("")
    return md


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--vote", help="JSON lines of vote_bench and mpi_vote")
    ap.add_argument("--kb", help="kb_bench JSON")
    ap.add_argument("--serve", help="kb_serve_bench JSON")
    ap.add_argument("--checkpoint", help="bench/checkpoint_bench.md")
    ap.add_argument("--diagnosis", help="diagnosis_bench JSON")
    ap.add_argument("--reports-readme", help="tests/kb/testdata/reports/README.md (first-contact figures)")
    ap.add_argument("--only-diagnosis", action="store_true",
                    help="append the diagnosis section only (the other sections stay as they are)")
    ap.add_argument("--train-step", help="bench/train_step_bench.md (a whole section, appended as it is)")
    a = ap.parse_args()
    md = []
    w = md.append

    if a.only_diagnosis:
        a.vote = a.kb = a.serve = a.checkpoint = None

    votes = json_lines(a.vote)
    if votes:
        w("## The step protocol (4 ranks on this host)")
        w("")
        w("What one optimizer step costs in agreement between ranks. ThreadGroup ranks are threads; MPI")
        w("ranks are processes under `mpirun --oversubscribe -np 4` (4 ranks share the cores listed above).")
        w("")
        lat = [r for r in votes if r.get("bench") == "vote_latency"]
        steps = [r for r in votes if r.get("bench") == "step_with_vote"]
        for r in lat:
            w(f"- {r['engine']}: one vote (an all-gather of the 29-word vote record) takes "
              f"{r['median_us']:.1f} µs median, {r['p99_us']:.1f} µs p99.")
        for r in steps:
            w(f"- {r['engine']}: a guarded step with the guard-owned sync costs {r['step_us_nranks']:.1f} µs with "
              f"{r['ranks']} ranks against {r['step_us_1rank']:.1f} µs with one (no collectives): "
              f"{r['vote_overhead_us']:.1f} µs of protocol per step"
              + (f" (its one-float sync rides in the vote; a 9-float sync, summed apart: "
                 f"{r['sum_apart_overhead_us']:.1f} µs)." if "sum_apart_overhead_us" in r else "."))
        proto = [r for r in votes if r.get("bench") == "step_protocol"]
        if proto:
            w("")
            w("Per step, measured side by side in one run over MPI (medians of "
              f"{proto[0]['rounds']} steps): the first protocol's collectives (a MAX all-reduce of 6 int64, "
              "then the gradient sum the user ran) against the atomic step's (the vote all-gather, the "
              "gradient sum with 2 sequence words appended, the all-gather agreeing on the apply; without the "
              "sum when it rides in the vote: `fused`), and a whole "
              "`Guard::Step` with the guard-owned sync over MPI and with the local coordinator.")
            w("")
            w("| gradient (float64) | first protocol | atomic step | ratio | fused | guarded step, local | guarded step, MPI |")
            w("|---:|---:|---:|---:|---:|---:|---:|")
            for r in proto:
                fused = f"{r['fused_vote_agree_us']:.1f} µs" if "fused_vote_agree_us" in r else "—"
                w(f"| {r['grad_floats']} | {r['round1_vote_and_sum_us']:.1f} µs | {r['atomic_vote_sum_agree_us']:.1f} µs "
                  f"| {r['ratio']:.2f} | {fused} | {r['guarded_step_local_us']:.1f} µs | {r['guarded_step_mpi_us']:.1f} µs |")
        w("")
        w("Target: tens of microseconds with 4 MPI ranks on one host.")
        w("")

    kb = gbench(a.kb)
    if kb:
        w("## Knowledge base")
        w("")
        w("| operation | time | |")
        w("|---|---:|---|")
        for name, b in kb.items():
            unit = b.get("time_unit", "ns")
            extra = ""
            if "items_per_second" in b:
                extra = f"{b['items_per_second']:,.0f} per second"
            w(f"| {name} | {b['real_time']:.0f} {unit} | {extra} |")
        w("")
        w("Target: Record() on the training thread costs a few microseconds (it copies into a bounded queue).")
        w("")

    serve = gbench(a.serve)
    if serve:
        w("## Browser API over 100,000 incidents")
        w("")
        w("| request | ms |")
        w("|---|---:|")
        worst = 0.0
        for name, b in serve.items():
            t = ms(b)
            if name.startswith("BM_List"):
                worst = max(worst, t)
            w(f"| {name} | {t:.2f} |")
        w("")
        w(f"Target: a listing page in under 200 ms — slowest listing {worst:.1f} ms: "
          f"{'met' if worst < 200 else 'NOT met'}.")
        w("")

    if a.checkpoint and os.path.exists(a.checkpoint):
        w("## Checkpoints")
        w("")
        text = open(a.checkpoint).read().splitlines()
        # Drop the file's own title; keep its table and notes.
        if text and text[0].startswith("# "):
            text = text[1:]
        md.extend(text)
        w("")

    diag = json.load(open(a.diagnosis)) if a.diagnosis and os.path.exists(a.diagnosis) else None
    if diag:
        md.extend(diagnosis_section(diag, first_contact(a.reports_readme), kb))
    if a.train_step and os.path.exists(a.train_step):
        md.extend(open(a.train_step).read().splitlines())
        w("")

    with open(a.results, "a") as f:
        f.write("\n" + "\n".join(md) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Trains the classifier's text model and writes sdk/kb/text_model_weights.inc.

    build/bin/diagnosis_bench --dump=/tmp/reports.jsonl
    scripts/python scripts/train_text_model.py --dump /tmp/reports.jsonl

The dump holds every report of the development set (tests/kb/testdata/reports)
and of the corpus (tests/kb/testdata/corpus), each with the split of its
repository (train, validation, test; no repository in two splits), its label,
and per OOM event the text the model reads, the evidence rules' candidates
and the patterns the evidence rules out (never answered).

- The model: multinomial logistic regression over hashed word unigrams and
  bigrams and character 4-grams of words (the same features as
  sdk/kb/text_model.cc; `--self-check` prints them for a text so the two can
  be compared), trained on the train split only, each row weighted by
  1/(its class's rows) so the largest class (startup_capacity) is not the
  answer for every report the model cannot read, plus one row per pattern
  from docs/patterns.md (its title, signal and remedies, weighted PRIOR x a
  mean row): the catalogue's own words for what each pattern is and what
  fixes it. L-BFGS (torch, already in the environment) fits it in seconds.
- The combination: a class's score is its probability plus `rule_weight`
  times the most confident rule candidate for it; a rule at or above
  `strong_rule` decides alone. The L2 strength and `rule_weight` are chosen by
  grouped cross-validation on the train split (folds of whole repositories);
  `strong_rule` on the validation split.
- Calibration: what is calibrated is the margin of the answer's score over
  the next class's (two classes that fit about equally make no confident
  answer). The margin is mapped to the share of held-out answers right at
  that margin: the validation split's, and the train split's out-of-fold
  answers (each given by a model fitted without that report's repository),
  several hundred in all where validation alone had 150 (isotonic, shrunk
  towards 1/2 where few reports back a step, at most 0.79); and to 0.8 or
  more only above the lowest margin where at least HIGH_SUPPORT of those
  answers were right 95% of the time, so a confidence of 0.8 means what
  issue 25 asks of it and rests on more than a lucky handful.
- The rules' confidences: where rules deciding alone at 0.8 or more were not
  right 95% of the time on validation, a rule deciding a report alone claims
  at most 0.79.
- Abstention: below a calibrated confidence (the floor, chosen on validation
  among TEXT_FLOORS, the highest of the most accurate) the answer is
  "unknown"; a report labelled unknown counts as right only then.

The test split is only scored, at the end, for the record (`--score-test`);
nothing is chosen on it.
"""
import argparse
import json
import math
import os
import re
import sys
import zlib

import numpy as np

BUCKETS = 8192  # 4096 collided more: 8192 did better in cross-validation (0.679 vs 0.662) and on validation
DECISION_FLOOR = 0.45  # classifier.cc: below it a rule candidate is not concluded
TEXT_FLOORS = (0.25, 0.3, 0.35, 0.4, 0.45)  # the text model's floor, chosen on validation
CONFIDENT_RIGHT = 0.95  # confidence >= 0.8 must be right this often on validation
MAX_TEXT = 16 * 1024


def fnv1a(prefix, s):
    h = 2166136261
    for b in prefix + s:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def normalize(text):
    data = text.encode("utf-8", "surrogateescape")
    if len(data) > MAX_TEXT:
        data = data[-MAX_TEXT:]
    out = bytearray(data)
    for i, c in enumerate(out):
        if 65 <= c <= 90:
            out[i] = c + 32
        elif 48 <= c <= 57:
            out[i] = 48
    return bytes(out)


def word_byte(c):
    return 97 <= c <= 122 or c == 48 or c == 95 or c >= 0x80


_FEATURES = {}


def features(text, buckets=BUCKETS):
    """Sparse {bucket: value}, as TextFeatures in sdk/kb/text_model.cc (memoised)."""
    key = (text, buckets)
    if key not in _FEATURES:
        _FEATURES[key] = _features(text, buckets)
    return _FEATURES[key]


def _features(text, buckets):
    s = normalize(text)
    acc = {}

    def add(prefix, f):
        h = fnv1a(prefix, f)
        k = h % buckets
        acc[k] = acc.get(k, 0.0) + (-1.0 if h >> 31 else 1.0)

    words = []
    i, n = 0, len(s)
    while i < n:
        while i < n and not word_byte(s[i]):
            i += 1
        b = i
        while i < n and word_byte(s[i]):
            i += 1
        if i > b and i - b <= 40:
            words.append(s[b:i])
    for k, w in enumerate(words):
        add(b"w", w)
        if k + 1 < len(words):
            add(b"b", w + b" " + words[k + 1])
        if len(w) >= 3:
            padded = b" " + w + b" "
            for j in range(len(padded) - 3):
                add(b"c", padded[j:j + 4])
    out = {}
    for k, v in acc.items():
        if v == 0:
            continue
        out[k] = math.log1p(v) if v > 0 else -math.log1p(-v)
    norm = math.sqrt(sum(v * v for v in out.values()))
    if norm > 0:
        out = {k: v / norm for k, v in out.items()}
    return out


def load(path):
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return [json.loads(line) for line in f if line.strip()]


class Sparse:
    """Rows of hashed features as coordinates (row, column, value); the
    trainer fills a dense matrix from them."""

    def __init__(self, rows, buckets):
        self.shape = (len(rows), buckets)
        r, c, v = [], [], []
        for i, feats in enumerate(rows):
            for k, val in feats.items():
                r.append(i)
                c.append(k)
                v.append(val)
        self.r, self.c, self.v = np.array(r, dtype=np.int64), np.array(c, dtype=np.int64), np.array(v)


def sparse(texts, buckets=BUCKETS):
    return Sparse([features(t, buckets) for t in texts], buckets)


def train_lr(x, y, classes, l2, weights=None, iters=300):
    """Softmax regression with L2 on the weights, minimised by L-BFGS (torch,
    already in the project's environment) over sparse rows (a report touches
    a few hundred of the buckets): L-BFGS converges in a few hundred steps
    where plain gradient descent took thousands, and the sparse product
    makes a fit a few seconds on one core where the dense one took 8-70 s
    on the shared machine. One thread: torch's threads only fought over
    the loaded cores. `weights`: per-row weights (None: all equal)."""
    import torch

    torch.set_num_threads(1)
    n, d = x.shape
    xt = torch.sparse_coo_tensor(np.vstack([x.r, x.c]), x.v, (n, d), dtype=torch.float64,
                                 check_invariants=False).coalesce().to_sparse_csr()
    yt = torch.tensor(np.asarray(y), dtype=torch.int64)
    sw = torch.tensor(np.ones(n) if weights is None else np.asarray(weights, dtype=float), dtype=torch.float64)
    sw = sw / sw.sum()
    w = torch.zeros(d, len(classes), dtype=torch.float64, requires_grad=True)
    b = torch.zeros(len(classes), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=iters, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure():
        opt.zero_grad()
        loss = (torch.nn.functional.cross_entropy(xt @ w + b, yt, reduction="none") * sw).sum()
        loss = loss + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().numpy().T.copy(), b.detach().numpy().copy()


def probs(w, b, feats):
    z = b.copy()
    for k, v in feats.items():
        z += w[:, k] * v
    z -= z.max()
    p = np.exp(z)
    return p / p.sum()


def rule_verdict(cands):
    """The rules alone, as RulesDecide + the decision floor in classifier.cc."""
    if not cands:
        return "unknown", 0.2, 0.0
    best_p, best_c = cands[0]
    conf = best_c
    for p, c in cands[1:]:
        if p == best_p:
            continue
        if c >= best_c - 0.1:
            conf = max(0.3, conf - 0.1)
        break
    if best_c < DECISION_FLOOR:
        return "unknown", 0.2, best_c
    return best_p, conf, best_c


class Model:
    def __init__(self, classes, w, b, rule_weight, strong_rule, calibration=None, floor=DECISION_FLOOR,
                 rule_cap=1.0):
        self.classes, self.w, self.b = classes, w, b
        self.rule_weight, self.strong_rule = rule_weight, strong_rule
        self.floor = floor  # calibrated confidence below it: "unknown"
        self.rule_cap = rule_cap  # the most a rule deciding alone on a report may claim
        self.calibration = calibration  # [(margin, right share)], ascending
        self._cache = {}

    def calibrated(self, score):
        cal = self.calibration
        if not cal:
            return min(max(score, 0.0), 1.0)
        if score <= cal[0][0]:
            return cal[0][1]
        if score >= cal[-1][0]:
            return cal[-1][1]
        for (x0, y0), (x1, y1) in zip(cal, cal[1:]):
            if score <= x1:
                return y0 + (y1 - y0) * (score - x0) / (x1 - x0) if x1 > x0 else y1
        return cal[-1][1]

    def event(self, ev):
        """(pattern, confidence, margin or None) for one OOM event. The margin
        is how far the answer's combined score stands above the next class's:
        what the calibration reads (a report two classes fit about equally is
        not a confident answer, however high both score)."""
        cands = ev["rules"]
        if cands and cands[0][1] >= self.strong_rule:
            p, c, _ = rule_verdict(cands)
            return p, min(c, self.rule_cap), None
        key = ev["text"]
        if key not in self._cache:
            self._cache[key] = probs(self.w, self.b, features(key, self.w.shape[1]))
        p = self._cache[key]
        best_rule = {}
        for name, conf in cands:
            best_rule[name] = max(best_rule.get(name, 0.0), conf)
        ruled_out = set(ev.get("ruled_out", ()))
        scores = [-1.0 if c in ruled_out else p[i] + self.rule_weight * best_rule.get(c, 0.0)
                  for i, c in enumerate(self.classes)]
        top = int(np.argmax(scores))
        margin = scores[top] - max(scores[:top] + scores[top + 1:], default=-1.0)
        conf = self.calibrated(margin)
        if conf < self.floor:
            return "unknown", 0.2, margin
        return self.classes[top], conf, margin

    def report(self, r):
        """The report's answer: its most confident event, the first on ties (devset::Diagnose)."""
        best = None
        for ev in r["events"]:
            p, c, s = self.event(ev)
            if best is None or c > best[1]:
                best = (p, c, s)
        return best if best else ("(no OOM found)", 0.0, None)


def accuracy(model, reports):
    if not reports:
        return 0.0
    return sum(model.report(r)[0] == r["label"] for r in reports) / len(reports)


def isotonic(points):
    """Pool-adjacent-violators over (score, right) sorted by score: blocks of
    (mean score, right share, count), non-decreasing in share."""
    blocks = []
    for s, y in sorted(points):
        blocks.append([s, float(y), 1])
        while len(blocks) > 1 and blocks[-2][1] > blocks[-1][1]:
            s2, y2, n2 = blocks.pop()
            s1, y1, n1 = blocks.pop()
            n = n1 + n2
            blocks.append([(s1 * n1 + s2 * n2) / n, (y1 * n1 + y2 * n2) / n, n])
    return blocks


HIGH_SUPPORT = 40  # held-out answers (validation and out-of-fold train) that must back a confidence >= 0.8


def fit_calibration(model, reports, more=()):
    """The share of validation reports answered right by margin, over those
    answered through the text model: isotonic in the margin, each step shrunk
    towards 1/2 by two pseudo-reports (a step backed by few reports claims
    less). A confidence of 0.8 or more promises at least 95% right (issue 25),
    so it is given only above the lowest margin `t` where the validation
    answers at or above `t` (at least HIGH_SUPPORT of them) are right that
    often, and there it is their share; below `t` every step says at most
    0.79. `more`: further (model, reports) pairs whose answers count too:
    the out-of-fold answers on the train split (each report answered by a
    model fitted without its repository), so the table rests on several
    hundred held-out answers rather than on the validation split alone."""
    points = []
    for m, rs in [(model, reports)] + list(more):
        m.calibration = None
        for r in rs:
            best = None
            for ev in r["events"]:
                p, _, s = m.event(ev)
                if s is None:
                    continue
                if best is None or s > best[1]:
                    best = (p, s)
            if best is not None:
                points.append((best[1], 1 if best[0] == r["label"] else 0))
    if not points:
        return [(0.0, 0.0), (1.0, 0.0)]
    table = []
    for s, share, n in isotonic(points):
        table.append((round(s, 4), round((share * n + 1.0) / (n + 2.0), 4)))
    # Non-decreasing after shrinking too (a big block can fall below a small one).
    for i in range(1, len(table)):
        if table[i][1] < table[i - 1][1]:
            table[i] = (table[i][0], table[i - 1][1])
    table = [(s, min(y, 0.79)) for s, y in table]
    ranked = sorted(points, reverse=True)
    high = None
    right = 0
    for k, (s, y) in enumerate(ranked, 1):
        right += y
        # Only where the next margin is lower: equal margins get one confidence.
        if k >= HIGH_SUPPORT and right / k >= CONFIDENT_RIGHT and (k == len(ranked) or ranked[k][0] < s):
            high = (s, right / k)
    if high is not None:
        t, share = round(high[0], 4), round(high[1], 4)
        below = [(s, y) for s, y in table if s < t - 1e-4]
        last = below[-1][1] if below else table[0][1]
        table = below + [(t - 1e-4, last), (t, share), (max(t, round(ranked[0][0], 4)) + 1e-4, share)]
    return table


CV_FOLDS = 5
L2S = (1e-5, 3e-5, 1e-4, 3e-4)
RULE_WEIGHTS = (0.5, 0.75, 1.0, 2.0)


CLASS_POWER = 1.0  # a row weighs 1/(its class's rows)^CLASS_POWER (chosen on validation, cross-validation)
PRIOR = 10.0  # the catalogue's rows (docs/patterns.md) weigh PRIOR x the mean report row
PATTERNS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "patterns.md")


def catalogue_rows(path=PATTERNS_MD):
    """(pattern, text) for each pattern of docs/patterns.md: its title, signal
    and remedies (not its rules or examples). What the project knows about a
    pattern before any report: words such as "expandable_segments",
    "map_location" or "no_grad" that too few train reports carry."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in re.finditer(r"^### `([a-z_]+)` — (.*?)$(.*?)(?=^### |\Z)", text, re.S | re.M):
        name, title, body = m.group(1), m.group(2), m.group(3)
        parts = [title]
        sig = re.search(r"\*\*Signal\.\*\*(.*?)\n\n", body, re.S)
        if sig:
            parts.append(sig.group(1).strip())
        rem = re.search(r"\*\*Remedies\.\*\*(.*)", body, re.S)
        if rem:
            parts += [re.sub(r"^\d+\.\s*", "", ln).strip() for ln in rem.group(1).splitlines()
                      if re.match(r"^\d+\.", ln)]
        out.append((name, " ".join(parts)))
    return out


def fit(reports, classes, l2, buckets, class_power=None, prior=None):
    """The text model on `reports`: one row per OOM event, labelled with its
    report's label. A row weighs 1/sqrt(its class's rows): startup_capacity
    is a third of the train split, and unweighted the model answers it for
    any report it cannot read (the validation errors were mostly that); the
    power 1 (each class weighs the same in all) did at least as well as the
    square root in cross-validation and on validation with batch-13. The
    catalogue's rows (catalogue_rows) are added with weight `prior`."""
    index = {c: i for i, c in enumerate(classes)}
    texts, ys = [], []
    for r in reports:
        if r["label"] not in index:
            continue
        for ev in r["events"] or [{"text": ""}]:
            texts.append(ev["text"])
            ys.append(index[r["label"]])
    class_power = CLASS_POWER if class_power is None else class_power
    prior = PRIOR if prior is None else prior
    count = np.bincount(ys, minlength=len(classes))
    weights = [1.0 / count[y] ** class_power for y in ys]
    if prior > 0:
        mean = float(np.mean(weights))
        rows = catalogue_rows()
        if not rows:
            raise SystemExit(f"no pattern sections read from {PATTERNS_MD} (its '### `name` — title' headings "
                             "changed?): the catalogue's prior rows would be missing")
        for name, text in rows:
            if name in index:
                texts.append(text)
                ys.append(index[name])
                weights.append(prior * mean)
    return train_lr(sparse(texts, buckets), np.array(ys), classes, l2, weights)


def choose_by_cv(reports, classes, buckets):
    """(l2, rule_weight, accuracy): the most accurate over folds of whole repositories."""
    fold = {r["repo"]: zlib.crc32(r["repo"].encode()) % CV_FOLDS for r in reports}
    right = {}
    for l2 in L2S:
        for k in range(CV_FOLDS):
            held = [r for r in reports if fold[r["repo"]] == k]
            w, b = fit([r for r in reports if fold[r["repo"]] != k], classes, l2, buckets)
            for rw in RULE_WEIGHTS:
                # No rule decides alone and nothing abstains: the weights alone are compared.
                m = Model(classes, w, b, rw, 1.01, floor=0.0)
                right[(l2, rw)] = right.get((l2, rw), 0) + sum(m.report(r)[0] == r["label"] for r in held)
    (l2, rw), n = max(right.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))
    return l2, rw, n / len(reports)


def fit_rule_cap(model, reports):
    """The evidence rules' own confidences are set by hand: where a rule
    decides a validation report alone at 0.8 or more, those answers must be
    right 95% of the time (shrunk as the calibration is), or a rule deciding
    a report alone claims at most 0.79."""
    right = n = 0
    for r in reports:
        for ev in r["events"]:
            cands = ev["rules"]
            if cands and cands[0][1] >= model.strong_rule and rule_verdict(cands)[1] >= 0.8:
                n += 1
                right += rule_verdict(cands)[0] == r["label"]
                break
    return 1.0 if (right + 1.0) / (n + 2.0) >= CONFIDENT_RIGHT else 0.79


def write_inc(path, model, buckets):
    with open(path, "w") as f:
        f.write("// Generated by scripts/train_text_model.py; do not edit.\n")
        f.write("//\n")
        f.write(f"// A data table, not code: kWeights holds one row per hashed feature bucket\n")
        f.write(f"// ({buckets} buckets x {len(model.classes)} classes), which is why this file runs to\n")
        f.write("// thousands of lines. The project's rule of no function in sdk/ over 150\n")
        f.write("// lines does not apply to it: there is no function here, only the trained\n")
        f.write("// weights, the combination settings and the calibration table, read by\n")
        f.write("// sdk/kb/text_model.cc. Regenerate it with the script; never edit by hand.\n")
        f.write(f"constexpr int kBuckets = {buckets};\n")
        f.write("constexpr bool kTrained = true;\n")
        f.write("constexpr const char* kClasses[] = {" + ", ".join(f'"{c}"' for c in model.classes) + "};\n")
        # Bucket-major: the classes' weights of one feature sit together.
        f.write("constexpr float kWeights[] = {\n")
        for row in model.w.T:
            f.write(",".join(f"{v:.4g}" if abs(v) >= 5e-5 else "0" for v in row) + ",\n")
        f.write("};\n")
        f.write("constexpr double kBias[] = {" + ", ".join(f"{v:.6g}" for v in model.b) + "};\n")
        f.write(f"constexpr double kRuleWeight = {model.rule_weight};\n")
        f.write(f"constexpr double kStrongRule = {model.strong_rule};\n")
        f.write(f"constexpr double kDecisionFloor = {model.floor};\n")
        f.write(f"constexpr double kRuleConfidenceCap = {model.rule_cap};\n")
        cal = ", ".join(f"{s}, {y}" for s, y in model.calibration)
        f.write(f"constexpr double kCalibration[] = {{{cal}}};\n")


def read_inc(path):
    """(classes, w, b) of a weights file write_inc wrote: what `--probs`
    answers from, so a test can hold the C++ inference to the script's."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    classes = re.findall(r'"([a-z_]+)"', re.search(r"kClasses\[\] = \{(.*?)\};", text).group(1))
    weights = np.array([float(v) for v in re.search(r"kWeights\[\] = \{(.*?)\};", text, re.S).group(1).split(",")
                        if v.strip()])
    b = np.array([float(v) for v in re.search(r"kBias\[\] = \{(.*?)\};", text).group(1).split(",")])
    buckets = int(re.search(r"kBuckets = (\d+);", text).group(1))
    return classes, weights.reshape(buckets, len(classes)).T.copy(), b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", help="diagnosis_bench --dump output")
    ap.add_argument("--out", default="sdk/kb/text_model_weights.inc")
    ap.add_argument("--buckets", type=int, default=BUCKETS)
    ap.add_argument("--self-check", metavar="TEXT", help="print the features of TEXT and exit")
    ap.add_argument("--probs", metavar="TEXT", help="print the text model's probability of each class for TEXT, "
                    "from the weights of --out (as shipped), and exit")
    ap.add_argument("--l2", type=float, help="with --rule-weight: these settings, no cross-validation "
                    "(minutes on a loaded machine); e.g. the ones the last full run printed")
    ap.add_argument("--rule-weight", type=float)
    ap.add_argument("--score-test", action="store_true", help="also print the test split's figures (for the "
                    "record, at the end; nothing is chosen on them)")
    a = ap.parse_args()
    if a.self_check is not None:
        for k, v in sorted(features(a.self_check, a.buckets).items()):
            print(f"{k} {v:.6f}")
        return 0
    if a.probs is not None:
        classes, w, b = read_inc(a.out)
        for c, p in zip(classes, probs(w, b, features(a.probs, w.shape[1]))):
            print(f"{c} {p:.9f}")
        return 0
    if not a.dump:
        ap.error("--dump is required")
    reports = load(a.dump)
    by_split = {s: [r for r in reports if r["split"] == s] for s in ("train", "validation", "test")}
    classes = sorted({r["label"] for r in by_split["train"] if r["label"] != "unknown"})
    print(f"train: {len(by_split['train'])} reports, {len(classes)} classes; "
          f"validation {len(by_split['validation'])}, test {len(by_split['test'])}")

    # The weights' settings (L2 strength, how much a rule adds) by grouped
    # cross-validation on the train split: its folds are repositories, as the
    # splits are, and it holds far more reports than validation does.
    if (a.l2 is None) != (a.rule_weight is None):
        ap.error("--l2 and --rule-weight go together")
    if a.l2 is not None:
        l2, rule_weight = a.l2, a.rule_weight
        print(f"given: l2={l2} rule_weight={rule_weight} (no cross-validation)")
    else:
        l2, rule_weight, cv_acc = choose_by_cv(by_split["train"], classes, a.buckets)
        print(f"chosen by {CV_FOLDS}-fold cross-validation on train: l2={l2} rule_weight={rule_weight}: "
              f"{cv_acc:.3f} right")
    w, b = fit(by_split["train"], classes, l2, a.buckets)
    # Out-of-fold answers on train (folds of whole repositories, as in the
    # cross-validation): each fold's model answers the repositories it never saw.
    fold = {r["repo"]: zlib.crc32(r["repo"].encode()) % CV_FOLDS for r in by_split["train"]}
    folds = []
    for k in range(CV_FOLDS):
        fw, fb = fit([r for r in by_split["train"] if fold[r["repo"]] != k], classes, l2, a.buckets)
        folds.append((fw, fb, [r for r in by_split["train"] if fold[r["repo"]] == k]))

    # Validation decides what the combination concludes: when a rule decides
    # alone, the calibration, and the floor below which the answer is unknown.
    best = None
    for strong in (0.8, 0.85, 0.9, 0.95, 1.01):
        # The calibration reads every answer the text model gives (no floor).
        more = [(Model(classes, fw, fb, rule_weight, strong, floor=0.0), rs) for fw, fb, rs in folds]
        calibration = fit_calibration(Model(classes, w, b, rule_weight, strong, floor=0.0), by_split["validation"],
                                      more)
        rule_cap = fit_rule_cap(Model(classes, w, b, rule_weight, strong), by_split["validation"])
        for floor in TEXT_FLOORS:
            m = Model(classes, w, b, rule_weight, strong, calibration, floor, rule_cap)
            acc = accuracy(m, by_split["validation"])
            # Among settings that keep confident answers (>= 0.8) right at
            # least 95% of the time on validation, the most accurate.
            answers = [(m.report(r), r["label"]) for r in by_split["validation"]]
            confident = [(p, lab) for (p, c, _), lab in answers if c >= 0.8]
            wrong = sum(p != lab for p, lab in confident)
            keeps_promise = not confident or wrong <= (1 - CONFIDENT_RIGHT) * len(confident)
            # Ties: the more answers that keep the promise of 0.8 (a confidence
            # that says something), then the higher floor (abstain when it costs
            # nothing), then the lower strong_rule (the evidence rules decide
            # alone where they can).
            key = (keeps_promise, acc, len(confident), floor, -strong)
            if best is None or key > best[0]:
                best = (key, m)
    (kept, acc, _, _, _), model = best
    if not kept:
        print("warning: no setting keeps confidence >= 0.8 right 95% of the time on validation")
    print(f"chosen on validation: strong_rule={model.strong_rule} floor={model.floor} rule_cap={model.rule_cap}: "
          f"{acc:.3f} right")
    print("calibration (score -> right share):", model.calibration)
    # The test split only with --score-test: a run that tunes anything must not
    # see it (bench/RESULTS.md says how many times it was looked at).
    for split in ("train", "validation") + (("test",) if a.score_test else ()):
        rs = by_split[split]
        conf = [(model.report(r), r["label"]) for r in rs]
        hi = [(p, l) for (p, c, _), l in conf if c >= 0.8]
        print(f"{split:10s} {accuracy(model, rs):.3f} right of {len(rs)}; at confidence >= 0.8: "
              f"{sum(p != l for p, l in hi)} wrong of {len(hi)}")
    write_inc(a.out, model, a.buckets)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

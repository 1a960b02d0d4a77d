#!/usr/bin/env python3
"""Fails on an #include that points up the component graph.

    scripts/check_layering.py [--root DIR]              check the tree
    scripts/check_layering.py [--root DIR] --self-test  prove the check fails

Every file under sdk/<component>/ and every public header under
include/oomguard/ belongs to a component; each of its #include "..." lines
must name a header of the same component or of one it may depend on
(ALLOWED below, the graph sdk/CMakeLists.txt draws). The build must declare
the same graph: every component but torch has an oomguard_component() (or,
for the cli, oomguard_tool()) declaration whose DEPENDS, with everything they
depend on, are exactly its ALLOWED set, so that the build and this check
cannot drift apart in either direction. Unit tests (*_test.cc) are held to
their component's rules too.

The build holds the same arrows for symbols (oomguard_<name>_alone links each
component, server included, with its dependencies only; the cli executable
links only the components it declares); this check catches what a linker
cannot see: types, inline functions and templates from a header above.

--self-test copies the tree into a scratch directory, plants an upward
include of each kind there (a source, a public header, an unmapped header,
an upward DEPENDS, a DEPENDS short of the graph) and expects each to be
reported.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys
import tempfile

# The intended graph: what each component may include besides itself.
ALLOWED = {
    "core": set(),
    "memory": {"core"},
    "dist": {"core"},
    "checkpoint": {"core"},
    "kb": {"core", "memory"},
    "guard": {"core", "memory", "dist"},
    "server": {"core", "memory", "kb"},
    "cli": {"core", "memory", "dist", "checkpoint", "kb", "guard", "server"},
    # liboomguard_torch: libtorch training on the public API below it.
    "torch": {"core", "memory", "dist", "checkpoint", "guard"},
}
# Components the build does not declare with oomguard_component(): torch is a
# shared library of its own on liboomguard's public API (sdk/CMakeLists.txt).
UNDECLARED = {"torch"}

# Public headers and the component each belongs to. The seams every
# component meets at (Incident, RecoveryStore, MicroBatchPriors) and the OOM
# error types are the core's, so that the guard, the checkpointer and the
# knowledge base need not know one another. A new public header must be
# added here.
PUBLIC_HEADERS = {
    "export.h": "core",
    "version.h": "core",
    "status.h": "core",
    "faults.h": "core",
    "logging.h": "core",
    "dtype.h": "core",
    "incident.h": "core",
    "recovery.h": "core",
    "priors.h": "core",
    "oom_error.h": "core",
    "device.h": "memory",
    "oom.h": "memory",
    "coordinator.h": "dist",
    "mpi_coordinator.h": "dist",
    "nccl_coordinator.h": "dist",
    "guard.h": "guard",
    "options.h": "guard",
    "plan.h": "guard",
    "size_controller.h": "guard",
    "checkpoint.h": "checkpoint",
    "knowledge_base.h": "kb",
    "torch.h": "torch",
    "torch_budget.h": "torch",
    # The umbrella includes everything; no component may include it.
    "oomguard.h": "umbrella",
}
ALLOWED["umbrella"] = set(ALLOWED) - {"server", "cli", "torch"}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
COMPONENT_DECL = re.compile(r"oomguard_(?:component|tool)\(\s*(\w+)((?:\s+DEPENDS(?:\s+\w+)+)?)\s+SOURCES",
                            re.MULTILINE)


def component_of(root: pathlib.Path, path: pathlib.Path) -> str | None:
    rel = path.relative_to(root).parts
    if len(rel) >= 3 and rel[0] == "sdk" and rel[1] in ALLOWED:
        return rel[1]
    if len(rel) == 3 and rel[0] == "include" and rel[1] == "oomguard":
        return PUBLIC_HEADERS.get(rel[2], "?")
    return None


def component_of_include(name: str) -> str | None:
    parts = name.split("/")
    if parts[0] == "sdk" and len(parts) >= 3:
        return parts[1] if parts[1] in ALLOWED else "?"
    if parts[0] == "oomguard" and len(parts) == 2:
        return PUBLIC_HEADERS.get(parts[1], "?")
    return None  # the file's own directory or a third-party header


def check(root: pathlib.Path) -> list[str]:
    problems = []
    files = sorted(p for d in ("sdk", "include/oomguard") for p in (root / d).rglob("*")
                   if p.suffix in (".cc", ".h", ".cpp"))
    for path in files:
        rel = path.relative_to(root)
        mine = component_of(root, path)
        if mine is None:
            continue
        if mine == "?":
            problems.append(f"{rel}: a public header of no component (add it to PUBLIC_HEADERS in {__file__})")
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in INCLUDE.finditer(text):
            theirs = component_of_include(m.group(1))
            if theirs is None or theirs == mine:
                continue
            line = text.count("\n", 0, m.start()) + 1
            if theirs == "?":
                problems.append(f"{rel}:{line}: includes \"{m.group(1)}\", which belongs to no component")
            elif theirs not in ALLOWED[mine]:
                problems.append(f"{rel}:{line}: {mine} includes \"{m.group(1)}\" of {theirs} "
                                f"({mine} may include {', '.join(sorted(ALLOWED[mine])) or 'only itself'})")
    declared: dict[str, tuple[str, list[str]]] = {}  # name -> (where, DEPENDS)
    for cmake in sorted((root / "sdk").rglob("CMakeLists.txt")):
        text = cmake.read_text(encoding="utf-8")
        for m in COMPONENT_DECL.finditer(text):
            name = m.group(1)
            deps = m.group(2).split()[1:]
            where = f"{cmake.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}"
            if name not in ALLOWED:
                problems.append(f"{where}: component {name} is not in the graph")
                continue
            declared[name] = (where, deps)
            for dep in deps:
                if dep not in ALLOWED[name]:
                    problems.append(f"{where}: component {name} DEPENDS on {dep}, which is not below it")
    for name in sorted(set(ALLOWED) - UNDECLARED - {"umbrella"}):
        if name not in declared:
            problems.append(f"component {name} is in the graph but no sdk/ CMakeLists.txt declares it")
            continue
        where, deps = declared[name]
        missing = ALLOWED[name] - closure(deps, declared)
        if missing:
            problems.append(f"{where}: component {name} may include {', '.join(sorted(missing))} (ALLOWED in "
                            f"{pathlib.Path(__file__).name}) but its DEPENDS do not reach it; the graph and the "
                            f"build must agree")
    return problems


def closure(deps: list[str], declared: dict[str, tuple[str, list[str]]]) -> set[str]:
    """`deps` and everything they depend on, as the build declares it."""
    seen: set[str] = set()
    todo = list(deps)
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo.extend(declared.get(d, ("", []))[1])
    return seen


def self_test(root: pathlib.Path) -> int:
    """Each plant must be reported; the untouched copy must pass."""
    plants = [
        ("sdk/core/status.cc", '#include "oomguard/guard.h"\n', "core includes \"oomguard/guard.h\" of guard"),
        ("sdk/checkpoint/commit.cc", '#include "sdk/guard/guard_impl.h"\n',
         "checkpoint includes \"sdk/guard/guard_impl.h\" of guard"),
        ("include/oomguard/incident.h", '#include "oomguard/device.h"\n',
         "core includes \"oomguard/device.h\" of memory"),
        ("sdk/kb/store.cc", '#include "oomguard/oomguard.h"\n', "kb includes \"oomguard/oomguard.h\" of umbrella"),
        ("sdk/server/report.cc", '#include "oomguard/guard.h"\n', "server includes \"oomguard/guard.h\" of guard"),
        ("include/oomguard/new_thing.h", "// a header nobody placed\n", "a public header of no component"),
    ]
    failures = 0
    with tempfile.TemporaryDirectory(prefix="oomguard-layering-") as tmp:
        scratch = pathlib.Path(tmp)
        for d in ("sdk", "include"):
            shutil.copytree(root / d, scratch / d)
        clean = check(scratch)
        if clean:
            print("self-test: the untouched copy already fails:\n  " + "\n  ".join(clean))
            return 1
        for rel, line, expected in plants:
            target = scratch / rel
            before = target.read_text(encoding="utf-8") if target.exists() else None
            target.write_text(line + (before or ""), encoding="utf-8")
            found = [p for p in check(scratch) if expected in p]
            if found:
                print(f"self-test: planted in {rel}: reported: {found[0]}")
            else:
                print(f"self-test: planted in {rel}: NOT reported (expected '{expected}')")
                failures += 1
            if before is None:
                target.unlink()
            else:
                target.write_text(before, encoding="utf-8")
        # The graph allows an arrow the build does not draw.
        main_cmake = scratch / "sdk" / "CMakeLists.txt"
        text = main_cmake.read_text(encoding="utf-8")
        planted = text.replace("oomguard_component(kb DEPENDS core memory SOURCES",
                               "oomguard_component(kb DEPENDS core SOURCES")
        if planted == text:
            print("self-test: could not drop DEPENDS memory from kb in sdk/CMakeLists.txt")
            failures += 1
        else:
            main_cmake.write_text(planted, encoding="utf-8")
            found = [p for p in check(scratch) if "component kb may include memory" in p]
            print(f"self-test: dropped DEPENDS memory from kb: {'reported: ' + found[0] if found else 'NOT reported'}")
            failures += 0 if found else 1
            main_cmake.write_text(text, encoding="utf-8")
        # An upward arrow declared in the build.
        cmake = scratch / "sdk" / "checkpoint" / "CMakeLists.txt"
        text = cmake.read_text(encoding="utf-8")
        planted = re.sub(r"oomguard_component\(checkpoint DEPENDS core", "oomguard_component(checkpoint DEPENDS core guard",
                         text)
        if planted == text:
            print("self-test: could not plant DEPENDS guard in sdk/checkpoint/CMakeLists.txt")
            failures += 1
        else:
            cmake.write_text(planted, encoding="utf-8")
            found = [p for p in check(scratch) if "checkpoint DEPENDS on guard" in p]
            print(f"self-test: planted DEPENDS guard in checkpoint: {'reported: ' + found[0] if found else 'NOT reported'}")
            failures += 0 if found else 1
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parents[1])
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    root = args.root.resolve()
    if args.self_test:
        return self_test(root)
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"layering: {len(problems)} upward or unplaced include(s); the graph is in sdk/CMakeLists.txt")
        return 1
    print("layering: every include points down the component graph")
    return 0


if __name__ == "__main__":
    sys.exit(main())

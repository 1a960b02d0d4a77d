"""The integration tests share tests/python's set-up (the package from the
build tree, no fault rules left over: its conftest, loaded under a name of its
own) and cases.py (the models, data and runs)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

_spec = importlib.util.spec_from_file_location("oomguard_tests_conftest", HERE.parent / "conftest.py")
_shared = importlib.util.module_from_spec(_spec)
sys.modules["oomguard_tests_conftest"] = _shared
_spec.loader.exec_module(_shared)

REPO = _shared.REPO
subprocess_env = _shared.subprocess_env
_no_fault_rules = _shared._no_fault_rules  # autouse: each test starts and ends without fault rules

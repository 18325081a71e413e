"""pytest configuration shared by the test suite: hypothesis profiles.

Profiles (choose with ``HYPOTHESIS_PROFILE=<name>``; "ci" is the default):

- ``ci``: a modest number of examples per property (the whole suite takes about 25 minutes on two cores,
  the fast lane ``-m "not slow"`` under 5); every end-to-end example compiles a program (~50-100 ms), so
  the example count is much of the run time.
- ``dev``: five times the examples, for a local run before pushing.
- ``thorough``: many examples, for hunting bugs overnight.

``deadline=None`` everywhere: the first build of a program pays for LLVM's
start-up, which would trip a per-example deadline without saying anything
about cuvil.  Tests that compile heavier programs ask for a fraction of the
profile's examples through :func:`reference.budget` (tests/support/reference.py).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# the test modules (in tests/unit, tests/schedule, ... tests/e2e) import their helpers from tests/support as
# ``reference``, ``toolchain``, ...; make that work whatever pytest's import mode is.  Child processes that import
# a helper by name (tuning workers, scripts run by a test) get the same folder through PYTHONPATH.
SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

for _name, _examples in (("ci", 20), ("dev", 100), ("thorough", 1000)):
    settings.register_profile(
        _name,
        max_examples=_examples,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# the kernel cache: a temporary directory for the run unless CUVIL_CACHE_DIR names one (CI names an empty
# one; set it to keep a warm cache between local runs), so the suite never writes into ~/.cache/cuvil
if "CUVIL_CACHE_DIR" not in os.environ:
    os.environ["CUVIL_CACHE_DIR"] = tempfile.mkdtemp(prefix="cuvil-test-kernels-")
    atexit.register(shutil.rmtree, os.environ["CUVIL_CACHE_DIR"], True)


@pytest.fixture
def fresh_kernels(monkeypatch):
    """No kernel lowered before the test is reused, and none it lowers outlives it (in memory or on disk):
    for tests that change how kernels are lowered."""
    from cuvil.graph.compile import clear_kernels

    monkeypatch.setenv("CUVIL_CACHE_DIR", "off")
    clear_kernels()
    yield
    clear_kernels()


@pytest.fixture(scope="module", params=os.environ.get("CUVIL_E2E_SCHEDULES", "te,auto").split(","))
def each_schedule(request):
    """Every program a module builds through ``reference.build`` / ``compile_and_run``, built twice: in
    the te order and under ``auto_schedule`` (``pytestmark = pytest.mark.usefixtures("each_schedule")``;
    ``CUVIL_E2E_SCHEDULES=te`` keeps one, as the CUDA suite's subprocess does)."""
    import reference

    reference.SCHEDULE = request.param
    yield request.param
    reference.SCHEDULE = "te"

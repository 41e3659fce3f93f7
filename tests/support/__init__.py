"""Helpers shared by the tests, the check scripts, the benchmarks and the main job's meters (never installed).

* :mod:`tests.support.models`: small models (``TwoHalves``, ``TinyEncoder``,
  a Llama-shaped decoder);
* :mod:`tests.support.meters`: peak memory over a baseline, model state by kind;
* :mod:`tests.support.digests`: sha256 of weights, to compare ranks and runs;
* :mod:`tests.support.exits`: counts aborts at interpreter exit of repeated 2-rank runs;
* :mod:`tests.support.faults`: kills a checkpoint save part-way (torn-checkpoint tests);
* :mod:`tests.support.switch_leaks`: what a DDP switch must free, and the guard that fails when it does not;
* :mod:`tests.support.fake_strategy`: a strategy registered by the tests only (the seam's proof).
* :mod:`tests.support.benchmark_cli`: a benchmark's command line run in the test's own process.
* :mod:`tests.support.stub_drift`: compares a stub of ours (``typings/<library>``) with the installed library.

Imported as ``tests.support.x`` with the repository root on ``sys.path``
(pytest: ``pythonpath = .`` in ``setup.cfg``; the benchmarks, the check
scripts and ``examples/fit_large_model.py`` insert it themselves).
"""

"""tools/bench/e2e.py runs the three end-to-end workloads: even and uneven itself, long_tail by
handing its other arguments to tools/bench/e2e_long_tail.py (whose flags differ)."""

import pytest

from omniscale.tools.bench import e2e


def test_long_tail_is_run_by_its_own_script_with_its_own_flags():
    # --retries is the long-tail script's alone: e2e.py's own parser would refuse it; the
    # long-tail script refuses --steps 3 (not a multiple of its window) before it reads data
    with pytest.raises(SystemExit, match="multiples of the window"):
        e2e.main(["--workload", "long_tail", "--schedule", "separate", "--retries", "0",
                  "--steps", "3"])


def test_long_tail_refuses_steps_where_the_turns_set_the_run_s_length(capsys):
    # the default schedule (the policies in turns) makes each run warm-up + one window per
    # policy and cycle: a given --steps would be silently ignored, so it is refused
    with pytest.raises(SystemExit):
        e2e.main(["--workload", "long_tail", "--steps", "12"])
    assert "--steps 12: with --schedule interleaved" in capsys.readouterr().err


def test_even_and_uneven_keep_e2e_py_s_flags():
    assert e2e._workload(["--rounds", "2"]) == ("even", ["--rounds", "2"])
    assert e2e._workload(["--workload", "uneven", "--rounds", "1"]) == ("uneven", ["--rounds", "1"])
    with pytest.raises(SystemExit):  # e2e.py's parser: --retries is not one of its flags
        e2e.main(["--retries", "0"])

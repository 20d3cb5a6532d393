"""The ``omniscale`` command starts without torch: its parser and the data plane's commands
(``plane serve``, ``status``, ``audit``) need none, and importing it costs about a second of
CPU in every such process -- a plane restarted after a crash, a status poll. Checked in a fresh
interpreter (this one has long imported torch)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
from omniscale.tools.cli import build_parser
build_parser().parse_args(["plane", "status", "grpc://127.0.0.1:1"])
import omniscale.dataplane.audit, omniscale.dataplane.client, omniscale.dataplane.metrics
import omniscale.dataplane.plane, omniscale.dataplane.server, omniscale.tools.plane_status
print("torch" in sys.modules)
"""


def test_the_parser_and_the_plane_commands_import_no_torch():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"

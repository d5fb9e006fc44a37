"""`hdr` as `accelerate launch` starts it for the two-process TRL tests, with settings that may
differ by process: the command line, then the overrides in `HDR_TEST_RANK{RANK}_ARGS`
(shell-quoted). Only what a process does alone (its questions, its rollout's token budget)
is given this way, so the processes' responses differ in length as real ones do."""

import os
import shlex
import sys

from hdr.cli import main

if __name__ == "__main__":
    extra = shlex.split(os.environ.get(f"HDR_TEST_RANK{os.environ.get('RANK', '0')}_ARGS", ""))
    main([*sys.argv[1:], *extra])

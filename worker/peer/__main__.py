"""``torchrun --nproc-per-node N -m worker.peer --task gpt ...``: one peer rank."""
import sys

from worker.peer.cli import main

sys.exit(main())

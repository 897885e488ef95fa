import sys

from raftmq.cli import main

sys.exit(main())

import sys

from probcaps.cli import main

sys.exit(main())

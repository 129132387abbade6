import sys

from ft.cli import main

sys.exit(main())

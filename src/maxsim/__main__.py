import sys

from maxsim.cli import main

sys.exit(main())

import sys

from ebbtide.cli import main

sys.exit(main())

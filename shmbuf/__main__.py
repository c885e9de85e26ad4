import sys

from shmbuf._cli import main

sys.exit(main())

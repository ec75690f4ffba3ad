import sys

from omnibench.tables import main

sys.exit(main())

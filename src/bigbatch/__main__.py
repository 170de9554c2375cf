import sys

from bigbatch.cli.main import main

sys.exit(main())

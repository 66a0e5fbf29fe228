"""``python -m apf_gunicorn``: the command line (see :mod:`apf_gunicorn.cli`)."""

import sys

from apf_gunicorn.cli import main

sys.exit(main())

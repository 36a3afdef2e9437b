"""``python -m graphormer_urpe.pretrained CHECKPOINT OUT``: see :mod:`graphormer_urpe.pretrained`."""
import sys

from graphormer_urpe.pretrained import main

sys.exit(main())

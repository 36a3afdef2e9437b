"""``python -m graphormer_urpe.pretrained CHECKPOINT OUT``: see :mod:`graphormer_urpe.pretrained`."""
from graphormer_urpe.pretrained import main

main()

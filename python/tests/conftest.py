"""Every test runs against simulated devices inside libresmem (RESMEM_DRIVER=sim): two 24 GiB
devices. The library is the package's own (an installed resmem carries it; see setup.py), the
one RESMEM_LIBRARY names, or, from a checkout's source folder, its target/ build."""

import os

os.environ["RESMEM_DRIVER"] = "sim"
os.environ["CUDA_SIM_DEVICES"] = "24GiB,24GiB"
os.environ.pop("RESMEM_CONF", None)

"""Every test runs against simulated devices inside libresmem (RESMEM_DRIVER=sim): two 24 GiB
devices. The library is the one named by RESMEM_LIBRARY, or this checkout's target/debug."""

import os

os.environ["RESMEM_DRIVER"] = "sim"
os.environ["CUDA_SIM_DEVICES"] = "24GiB,24GiB"
os.environ.pop("RESMEM_CONF", None)
_built = os.path.join(os.path.dirname(__file__), "..", "..", "target", "debug", "libresmem.so")
if "RESMEM_LIBRARY" not in os.environ and os.path.exists(_built):
    os.environ["RESMEM_LIBRARY"] = os.path.abspath(_built)

"""redraft: speculative decoding toolkit."""

__version__ = "0.1.0"

# transformers' AutoConfig/AutoModel learn the ReDrafter head once their Auto classes load; this
# imports neither torch nor transformers now (see redraft/models/auto.py).
from redraft.models.auto import install as _install_auto  # noqa: E402

_install_auto()

"""The embedded demo of ``lightning-zero-train``: a character-level GPT on text that ships with Python.

No download: the text is the documentation topics of the standard library module ``pydoc_data.topics`` (~465 KB
of English). The network is built in ``configure_model()`` from standard layers initialised by their own
``reset_parameters()``, so ``zero3_scratch`` can build it on the meta device and materialise it piece by piece.
"""

from lightning_zero.demo.data import CharTextDataModule, load_pydoc_text
from lightning_zero.demo.model import CharGPT, CharGPTModule

__all__ = ["CharGPT", "CharGPTModule", "CharTextDataModule", "load_pydoc_text"]

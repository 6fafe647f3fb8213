"""The embedded demo of ``lightning-zero-train``: a character-level GPT on text that ships with Python.

No download: the text is the documentation topics of the standard library module ``pydoc_data.topics`` (~465 KB
of English). The network is built in ``configure_model()`` from standard layers initialised by their own
``reset_parameters()``, so ``zero3_scratch`` can build it on the meta device and materialise it piece by piece.

A second task, :mod:`lightning_zero.demo.digits` (scikit-learn's 8x8 digits and an MLP classifier), needs the
``examples`` extra; the modules import scikit-learn only when they load the data. Every data module has
``model_kwargs()`` (what its model needs from the data) and every module records ``val_history``, ``(step, value)``
of its ``history_metric`` per validation pass.
"""

from lightning_zero.demo.data import CharTextDataModule, load_pydoc_text
from lightning_zero.demo.digits import DigitsDataModule, DigitsMLPModule
from lightning_zero.demo.model import CharGPT, CharGPTModule

__all__ = ["CharGPT", "CharGPTModule", "CharTextDataModule", "DigitsDataModule", "DigitsMLPModule", "load_pydoc_text"]

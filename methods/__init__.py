"""The methods' own knowledge, shared by server and board: one subpackage per method that needs one.

Exit heads (ScaleFL, DepthFL, FeDepth), FedTrans's growth and DynamicFL's re-parameterisation live here, above
the kernel and below every layer that builds models. Importing this package imports every subpackage
(nestling/discovery.py, as the zoo, strategies and procedures are found), so each registers what it brings (its
exit head under the name checkpoints carry): adding one is one folder. Server, edge, profiler and simulator
import it with their package, and the export modules that build or fold a model import it themselves.
"""

from __future__ import annotations

from nestling.discovery import import_modules

METHOD_PACKAGES = tuple(import_modules(__name__, __path__))

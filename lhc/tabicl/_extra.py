"""lhc.tabicl's classifier is a scikit-learn estimator: without scikit-learn, importing
the package says which extra to install."""

from lhc.extras import require

require("sklearn", "tabicl")

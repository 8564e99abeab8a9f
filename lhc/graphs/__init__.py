"""The range of graph operators (Bamberger et al., 2025) and a GNN zoo in Flax.

Distances (``shortest_path_distances``, ``resistance_distances``), influence by
Jacobians and Hessians (``node_influence``, ``graph_influence``, chunked), the range
measure (``range_measure``), synthetic tasks with known range (``lhc.graphs.synthetic``),
GCN / GIN / GINE / GAT / GatedGCN / GPS on padded graph batches (``GNN``), and loaders
for LRGB files a user has (``lhc.graphs.lrgb``).
"""

from lhc.graphs.batch import Graphs, from_adjacencies, from_edge_lists
from lhc.graphs.distances import connected, resistance_distances, shortest_path_distances
from lhc.graphs.influence import graph_influence, node_influence, node_ranges, range_measure
from lhc.graphs.models import GNN, LAYERS
from lhc.graphs.synthetic import SyntheticTask, operator, task_influence

__all__ = [
    "GNN",
    "LAYERS",
    "Graphs",
    "SyntheticTask",
    "connected",
    "from_adjacencies",
    "from_edge_lists",
    "graph_influence",
    "node_influence",
    "node_ranges",
    "operator",
    "range_measure",
    "resistance_distances",
    "shortest_path_distances",
    "task_influence",
]

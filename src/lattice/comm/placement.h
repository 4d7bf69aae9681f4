// Placement: which node each rank runs on, and whether the mesh's groups
// follow the rule that tensor parallelism stays inside a node.
//
// The mesh puts tp fastest (process_mesh.h), and mpirun fills a node's slots
// with consecutive ranks, so a TP group lives on one node exactly when tp
// divides the ranks per node, and a CP group (ranks tp apart) when tp × cp
// does. A TP group that spans nodes sends every layer's all-reduces over the
// network; that is the layout to warn about (docs/cluster.md).
#pragma once

#include <string>
#include <vector>

#include "lattice/comm/communicator.h"
#include "lattice/comm/process_mesh.h"

namespace lattice::comm {

// The node of every rank of `comm`, indexed by rank in comm. Collective over
// comm. Ranks share a node when MPI lets them share memory
// (MPI_COMM_TYPE_SHARED: under Open MPI, the node its launcher placed them
// on, even where network namespaces on one machine share a hostname); a node's
// name is MPI_Get_processor_name of its lowest rank, with " #k" appended when
// two nodes report the same name. A communicator that is not MPI's names every
// rank after this process's host.
std::vector<std::string> node_names(Communicator& comm);

// What the run header says about placement, for the mesh `sizes` whose world
// rank r runs on node_of_rank[r]. Pure. Empty when every rank is on one node;
// else a first line "nodes: 2 (node0: ranks 0-1; node1: ranks 2-3)" followed
// by where the TP and CP groups live, then one line per kind of group that
// spans nodes, starting "warning: ".
std::vector<std::string> describe_placement(const MeshSizes& sizes, const std::vector<std::string>& node_of_rank);

}  // namespace lattice::comm

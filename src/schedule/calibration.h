// Calibration on the live transport and in this process, for the auto scheduler's cost model:
// the link from probe allreduces, the codecs from timing them here, under whatever else the
// job runs (not an idle benchmark). Both are agreed over the ranks (the slowest rank's).
#pragma once

#include <string>
#include <vector>

#include "gradcomp/model/cluster.h"
#include "gradcomp/model/cost_model.h"
#include "gradcomp/transport.h"

namespace gradcomp::schedule {

struct LinkProbe {
  double bytes = 0;    // per rank
  double seconds = 0;  // the fastest of the repeats, the slowest rank's
};

struct LinkFit {
  model::Link link;               // as the cost model prices a ring allreduce
  std::vector<LinkProbe> probes;  // what it was fitted to
};

// Times allreduces of a few sizes (4 KiB to 4 MiB, the fastest of `repeats`) and fits the
// cost model's ring allreduce, 2 (p-1) alpha + 2 (p-1)/p n beta, by least squares: alpha is
// the latency, 1/beta the bandwidth, each held within what model::Cluster accepts. A
// collective; with one rank there is nothing to time (a fast, latency-free link is returned).
LinkFit calibrate_link(Transport& transport, int repeats = 3);

// The two links of a world of several nodes of several ranks (Transport::nodes): the one
// inside a node, fitted on every node's own transport at once (the slowest node's), and the
// one between nodes, fitted on the node leaders' transport alone, one stream per node (the
// NIC's rate: the cost model shares it among a node's ranks itself). A collective over
// `world`; every rank returns the same fits.
struct NodeLinkFit {
  LinkFit intra, inter;
};
NodeLinkFit calibrate_node_links(Transport& world, const NodeGroups& nodes, int repeats = 3);

// The fit itself, for `world` ranks. Probe times that do not grow with size (a loaded machine,
// or sizes too small to see the link) say nothing of the bandwidth: then the smallest probe's
// time counts as latency and the largest probe's as transfer, a conservative link, instead of
// an infinitely fast one.
model::Link fit_ring_link(const std::vector<LinkProbe>& probes, int world);

// The watch's probe of the link a calibration fitted, between searches: the time of one
// allreduce of `bytes` (the fastest of `repeats`, the slowest rank's) where that calibration
// probed, on `world` itself or, with `nodes`, between the node leaders (one stream per node).
// A collective over `world`; every rank returns the same time.
double time_link_probe(Transport& world, const NodeGroups* nodes, double bytes, int repeats = 2);

// Encode (with and without a residual) and decode-accumulate costs, a + b n, of each codec the
// options name and of "none" (the plain passes routes make), timed here at two sizes. A
// collective: the slowest rank's costs.
model::CodecCosts calibrate_codecs(Transport& transport, const std::vector<std::string>& options);

}  // namespace gradcomp::schedule

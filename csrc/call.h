// What one handler call is about to do, for the debug log, error messages and
// check mode alike.
#pragma once

#include <cstdint>

namespace mpijax {

inline constexpr int kUnset = -1000000;  // a field that does not apply to the call

// An array shape. Arrays of more than kMaxDims dimensions keep their first
// kMaxDims - 1 and fold the rest into the last, which still tells equal
// shapes from different ones wherever the element counts differ.
struct Shape {
  static constexpr int kMaxDims = 8;
  int ndim = 0;
  int64_t dims[kMaxDims] = {};
};

struct CallInfo {
  const char* op = "-";
  int64_t count = 0;
  const char* dtype = "-";
  int64_t bytes = 0;
  Shape shape;  // of the buffer that count and dtype describe
  int root = kUnset;
  int reduction = kUnset;  // a Reduction code
  int dest = kUnset;
  int source = kUnset;
  int send_tag = kUnset;
  int recv_tag = kUnset;
  // sendrecv only: the receive buffer (the fields above describe the send).
  const char* recv_dtype = nullptr;
  Shape recv_shape;
  // v-collectives: rows per rank (num_counts entries, one per rank), the
  // same on every rank; for alltoallv the rows this rank sends to each rank,
  // and recv_counts those it receives from each. Null otherwise.
  const int64_t* counts = nullptr;
  const int64_t* recv_counts = nullptr;
  int64_t num_counts = 0;
  // Calls of several messages (neighbor_exchange, start, wait), for the log:
  // the ranks they send to and receive from, in order. Null otherwise.
  const int64_t* to = nullptr;
  int64_t num_to = 0;
  const int64_t* from = nullptr;
  int64_t num_from = 0;
  // An axis whose length may differ between ranks (ragged_alltoall's rows),
  // or -1; the v-collectives' leading axis varies by their counts.
  int ragged_axis = -1;
  // Whether check mode agrees on the call first: not for neighbor_exchange,
  // whose messages go to several peers at once and are checked by size always.
  bool checked = true;
};

inline bool PointToPoint(const CallInfo& call) {
  return call.dest != kUnset || call.source != kUnset;
}

// Every rank of the communicator makes the call (check mode agrees on it);
// not the calls that post messages to several peers at once.
inline bool Collective(const CallInfo& call) { return call.checked && !PointToPoint(call); }

}  // namespace mpijax

// What differs in c10d between torch 1.13 and torch 2, in one place.
//
// torch 2.4 made libuv TCPStore's default backend (TCPStoreOptions::useLibUV,
// true since then), but Debian 13's torch 2.6 is built without libuv, so a
// store with the default options fails ("use_libuv was requested but PyTorch
// was build without libuv support"). The options field does not exist in
// torch 1.13; it is set where it does, found by overload resolution rather
// than by version number.
#pragma once

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace attnkit::train::c10d_compat {

namespace detail {
template <typename Options>
auto use_socket_backend(Options& o, int) -> decltype(o.useLibUV = false, void()) {
  o.useLibUV = false;
}
template <typename Options>
void use_socket_backend(Options&, long) {}  // no libuv option: sockets are the only backend
}  // namespace detail

/// TCPStore options on the backend every supported torch has (sockets).
inline c10d::TCPStoreOptions tcp_store_options() {
  c10d::TCPStoreOptions o;
  detail::use_socket_backend(o, 0);
  return o;
}

}  // namespace attnkit::train::c10d_compat

// A runtime row count as a compile-time one, for micro-kernels templated on their number of rows.
#pragma once
#include <type_traits>

// f(std::integral_constant<int, rows>{}) for rows in 1..MAX (MAX for anything larger).
template <int MAX, typename F>
inline void with_rows(int rows, F&& f) {
  if constexpr (MAX > 1) {
    if (rows < MAX) {
      with_rows<MAX - 1>(rows, f);
      return;
    }
  }
  f(std::integral_constant<int, MAX>{});
}

# The dependency versions attnkit supports: the two stacks it is built and
# tested on (README, Requirements), Debian 12's and Debian 13's.
#
#   dependency   Debian 12 (bookworm)   Debian 13 (trixie)   accepted
#   libtorch     1.13.1                 2.6.0                1.13 <= v < 2.7
#   oneDNN       2.6.3                  3.7.2                2.6 <= v < 4
#
# Their differences live in one file each: src/kernels/common/onednn_compat.h
# (oneDNN), src/runtime/allocator_compat.h (c10's allocator),
# src/train/c10d_compat.h (c10d), src/train/optimizer_compat.h (torch's
# optimiser archives) and cli/torch_sdpa.h (torch 2's own SDPA).
# A version outside the range stops the configure step with the reason;
# -DATTNKIT_ALLOW_UNTESTED_VERSIONS=ON turns that into a warning, for trying
# a newer release at one's own risk.
option(ATTNKIT_ALLOW_UNTESTED_VERSIONS
       "Only warn when libtorch or oneDNN is outside the tested versions" OFF)

function(attnkit_require_version what version min below)
  if(NOT version)
    set(problem "${what}'s CMake package states no version")
  elseif(version VERSION_LESS min OR NOT version VERSION_LESS below)
    set(problem "${what} ${version} is outside the versions attnkit supports "
                "(${min} <= version < ${below}: Debian 12's and Debian 13's)")
  else()
    message(STATUS "attnkit: ${what} ${version}")
    return()
  endif()
  string(JOIN "" problem ${problem})
  if(ATTNKIT_ALLOW_UNTESTED_VERSIONS)
    message(WARNING "${problem}; going on (ATTNKIT_ALLOW_UNTESTED_VERSIONS)")
  else()
    message(FATAL_ERROR "${problem}. Install Debian's packages (scripts/install-deps), point "
                        "CMAKE_PREFIX_PATH at a supported build, or pass "
                        "-DATTNKIT_ALLOW_UNTESTED_VERSIONS=ON to try it anyway.")
  endif()
endfunction()

attnkit_require_version(libtorch "${Torch_VERSION}" 1.13 2.7)
attnkit_require_version(oneDNN "${dnnl_VERSION}" 2.6 4)

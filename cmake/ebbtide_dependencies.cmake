# The build dependencies behind ebbtide's fast paths, each found or refused
# here (Note [No silent fallback]).
#
# Note [No silent fallback]: a library that is missing stops the configure,
# naming the package that provides it on Debian/Ubuntu and on RHEL-family
# systems and the option that accepts the slower build instead. pip hides
# CMake's warnings, so a warning would leave a user with the POSIX backend or
# without compression and no word of it; an explicit -D<option>=OFF is a
# choice, and ebbtide._core.build_info says what was built either way.

# Stops the configure: LIBRARY (what it is for) was not found; DEBIAN and RHEL
# name its development packages, OPTION the switch that builds without it and
# FALLBACK what that build does instead.
function(ebbtide_missing_library library what debian rhel option fallback)
  message(FATAL_ERROR
    "ebbtide: ${library} (${what}) not found. Install it:\n"
    "    Debian/Ubuntu:        apt-get install ${debian}\n"
    "    RHEL/Fedora/Rocky:    dnf install ${rhel}\n"
    "or accept a build without it (${fallback}) explicitly:\n"
    "    cmake -D${option}=OFF ...\n"
    "    pip install . -Ccmake.define.${option}=OFF\n")
endfunction()

# liburing: the io_uring backend; searched in the system and under
# $EBBTIDE_LIBURING_ROOT (an unpacked Debian package). The static library is
# preferred, so a wheel carries it inside its module.
set(EBBTIDE_HAVE_LIBURING OFF)
if(EBBTIDE_WITH_LIBURING)
  set(_uring_hint "")
  if(DEFINED ENV{EBBTIDE_LIBURING_ROOT})
    set(_uring_hint "$ENV{EBBTIDE_LIBURING_ROOT}")
  endif()
  find_path(LIBURING_INCLUDE_DIR liburing.h HINTS ${_uring_hint}/usr/include ${_uring_hint}/include)
  find_library(LIBURING_LIBRARY NAMES liburing.a uring
    HINTS ${_uring_hint}/usr/lib/x86_64-linux-gnu ${_uring_hint}/usr/lib/aarch64-linux-gnu ${_uring_hint}/lib)
  if(NOT (LIBURING_INCLUDE_DIR AND LIBURING_LIBRARY))
    ebbtide_missing_library(liburing "the io_uring storage backend" liburing-dev liburing-devel
                            EBBTIDE_WITH_LIBURING "the POSIX backend only: a thread pool of pread/pwrite")
  endif()
  set(EBBTIDE_HAVE_LIBURING ON)
  message(STATUS "ebbtide: liburing found: ${LIBURING_LIBRARY}")
else()
  message(STATUS "ebbtide: liburing disabled (EBBTIDE_WITH_LIBURING=OFF); only the POSIX backend will be built")
endif()

# zstd: checkpoint compression (compress="lossless" and "delta"), from the
# system, or built from upstream's lib/ sources in EBBTIDE_ZSTD_SOURCE into a
# static, position-independent library whose symbols stay inside the module
# (the manylinux wheel: scripts/manylinux_sysroot.sh).
set(EBBTIDE_HAVE_ZSTD OFF)
if(EBBTIDE_WITH_ZSTD AND EBBTIDE_ZSTD_SOURCE)
  if(NOT EXISTS "${EBBTIDE_ZSTD_SOURCE}/zstd.h")
    message(FATAL_ERROR "ebbtide: EBBTIDE_ZSTD_SOURCE=${EBBTIDE_ZSTD_SOURCE} holds no zstd.h (it names zstd's lib/ folder)")
  endif()
  enable_language(ASM)
  file(GLOB _zstd_sources ${EBBTIDE_ZSTD_SOURCE}/common/*.c ${EBBTIDE_ZSTD_SOURCE}/compress/*.c
       ${EBBTIDE_ZSTD_SOURCE}/decompress/*.c ${EBBTIDE_ZSTD_SOURCE}/decompress/*.S)
  add_library(ebbtide_zstd STATIC ${_zstd_sources})
  # Upstream's sources, compiled file by file as upstream does (Note [Unity build]).
  set_target_properties(ebbtide_zstd PROPERTIES C_VISIBILITY_PRESET hidden POSITION_INDEPENDENT_CODE ON
                        UNITY_BUILD OFF)
  target_compile_definitions(ebbtide_zstd PRIVATE ZSTDLIB_VISIBLE= ZSTDERRORLIB_VISIBLE= ZDICTLIB_VISIBLE=)
  set(ZSTD_LIBRARY ebbtide_zstd)
  set(ZSTD_INCLUDE_DIR ${EBBTIDE_ZSTD_SOURCE})
  set(EBBTIDE_HAVE_ZSTD ON)
  message(STATUS "ebbtide: zstd built from ${EBBTIDE_ZSTD_SOURCE}")
elseif(EBBTIDE_WITH_ZSTD)
  find_library(ZSTD_LIBRARY NAMES zstd)
  find_path(ZSTD_INCLUDE_DIR zstd.h)
  if(NOT (ZSTD_LIBRARY AND ZSTD_INCLUDE_DIR))
    ebbtide_missing_library(zstd "checkpoint compression" libzstd-dev libzstd-devel EBBTIDE_WITH_ZSTD
                            "checkpoints without compression: compress=\"lossless\" or \"delta\" raises an error saying so")
  endif()
  set(EBBTIDE_HAVE_ZSTD ON)
  message(STATUS "ebbtide: zstd found: ${ZSTD_LIBRARY}")
else()
  message(STATUS "ebbtide: zstd disabled (EBBTIDE_WITH_ZSTD=OFF); checkpoints cannot be compressed")
endif()

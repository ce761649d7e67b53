// Default sanitizer options of the instrumented executables (ATTNKIT_SANITIZE):
// the test binary, the fuzz targets and the CLI link this file, so a report
// looks the same however they are started. ASAN_OPTIONS / UBSAN_OPTIONS in the
// environment still override these. docs/RELIABILITY.md explains each choice.
extern "C" {

// Debian's llvm-14 installs llvm-symbolizer here, not on PATH.
#define ATTNKIT_SYMBOLIZER "external_symbolizer_path=/usr/lib/llvm-14/bin/llvm-symbolizer"

const char* __asan_default_options() {
  return "abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:"
         "check_initialization_order=1:strict_init_order=1:" ATTNKIT_SYMBOLIZER;
}

const char* __ubsan_default_options() { return "print_stacktrace=1:halt_on_error=1:" ATTNKIT_SYMBOLIZER; }

}  // extern "C"

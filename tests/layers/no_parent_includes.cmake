# cmake -DSOURCE_DIR=... -P no_parent_includes.cmake: fails when a file of
# src/, include/, cli/ or experiments/ includes a path that climbs out of its
# folder ("../"), which would pass around the layers' include roots.
file(GLOB_RECURSE files ${SOURCE_DIR}/src/*.h ${SOURCE_DIR}/src/*.cpp ${SOURCE_DIR}/include/*.h
     ${SOURCE_DIR}/cli/*.h ${SOURCE_DIR}/cli/*.cpp ${SOURCE_DIR}/experiments/*.h
     ${SOURCE_DIR}/experiments/*.cpp)
set(found)
foreach(file IN LISTS files)
  file(STRINGS ${file} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<][^\">]*\\.\\./")
  foreach(line IN LISTS lines)
    string(APPEND found "\n  ${file}: ${line}")
  endforeach()
endforeach()
if(found)
  message(FATAL_ERROR "includes that climb out of their folder:${found}")
endif()
list(LENGTH files count)
message(STATUS "${count} files, no include climbs out of its folder")

# Installs the built tree into a scratch prefix, then checks what a user of the
# installed tree meets: the CLI starts (its RUNPATH finds libattnkit), the
# Python package imports from outside the source tree and loads the installed
# library, and an outside CMake project builds and runs with find_package(attnkit).
set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix}
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()

# The installed CLI, with no LD_LIBRARY_PATH help.
execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${prefix}/bin/attnkit --version
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc OR NOT out MATCHES "^attnkit [0-9]+\\.[0-9]+\\.[0-9]+")
  message(FATAL_ERROR "installed attnkit --version failed (${rc}): ${out}${err}")
endif()
message(STATUS "installed CLI: ${out}")

# The installed Python package, imported from a directory outside the source
# tree: it must find the installed libattnkit, not the build tree's.
file(GLOB_RECURSE init_py ${prefix}/*/attnkit/__init__.py)
list(LENGTH init_py found)
if(NOT found EQUAL 1)
  message(FATAL_ERROR "expected one installed attnkit/__init__.py under ${prefix}, found: ${init_py}")
endif()
get_filename_component(package_dir ${init_py} DIRECTORY)
get_filename_component(python_path ${package_dir} DIRECTORY)
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env --unset=ATTNKIT_LIBRARY PYTHONPATH=${python_path}
          ${PYTHON} -c "import pathlib, torch, attnkit; \
lib = pathlib.Path(attnkit.library_path).resolve(); \
assert lib.is_relative_to(pathlib.Path('${prefix}').resolve()), lib; \
y = attnkit.linear(torch.ones(2, 3), torch.ones(4, 3)); \
assert y.shape == (2, 4) and bool((y == 3).all()), y; \
print('installed python package:', lib)"
  WORKING_DIRECTORY ${WORK_DIR}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc)
  message(FATAL_ERROR "importing the installed Python package failed (${rc}): ${out}${err}")
endif()
message(STATUS "${out}")

execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build
                        -G ${GENERATOR} -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer failed: ${rc}")
endif()

# Layers the build enforces (the table is in CMakeLists.txt, "The library").
#
# Each layer's code is compiled in targets of its own whose only include root
# of ours is the layer's *view*: a folder of symbolic links, made here at
# configure time, to the src/ folders and public headers of that layer and the
# layers below it, and to nothing above. An include of a higher layer's header
# therefore fails with "No such file or directory", in the build and in
# tests/layers (one probe per forbidden pair). No file moves for this: src/
# stays one tree to read and include/attnkit one tree for users.

set(ATTNKIT_LAYER_VIEWS ${PROJECT_BINARY_DIR}/layers)

# The layers up to and including `layer`, lowest first, into `out`.
function(attnkit_layers_through layer out)
  set(result)
  foreach(l IN LISTS ATTNKIT_LAYERS)
    list(APPEND result ${l})
    if(l STREQUAL layer)
      set(${out} ${result} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  message(FATAL_ERROR "attnkit: no layer named '${layer}' (layers: ${ATTNKIT_LAYERS})")
endfunction()

# Links `path` (relative to `from`) into `view`, unless a folder holding it is
# linked already (kernels covers kernels/common).
function(attnkit_link_into_view view from path)
  set(linked ${path})
  while(linked MATCHES "/")
    get_filename_component(linked ${linked} DIRECTORY)
    if(IS_SYMLINK ${view}/${linked})
      return()
    endif()
  endwhile()
  get_filename_component(parent ${view}/${path} DIRECTORY)
  file(MAKE_DIRECTORY ${parent})
  if(IS_DIRECTORY ${view}/${path} AND NOT IS_SYMLINK ${view}/${path})
    # A folder inside it was linked first: the whole folder replaces it.
    file(REMOVE_RECURSE ${view}/${path})
  endif()
  file(CREATE_LINK ${from}/${path} ${view}/${path} SYMBOLIC)
endfunction()

# (Re)makes the view of every layer: ${ATTNKIT_LAYER_VIEWS}/<layer>/ holds
# <folder> -> src/<folder> and attnkit/<header> -> include/attnkit/<header>
# for the layer and every layer below it.
function(attnkit_make_layer_views)
  file(REMOVE_RECURSE ${ATTNKIT_LAYER_VIEWS})
  foreach(layer IN LISTS ATTNKIT_LAYERS)
    set(view ${ATTNKIT_LAYER_VIEWS}/${layer})
    file(MAKE_DIRECTORY ${view})
    attnkit_layers_through(${layer} visible)
    foreach(l IN LISTS visible)
      foreach(folder IN LISTS ATTNKIT_LAYER_FOLDERS_${l})
        if(NOT IS_DIRECTORY ${PROJECT_SOURCE_DIR}/src/${folder})
          message(FATAL_ERROR "attnkit layer ${l}: src/${folder} does not exist")
        endif()
        attnkit_link_into_view(${view} ${PROJECT_SOURCE_DIR}/src ${folder})
      endforeach()
      foreach(header IN LISTS ATTNKIT_LAYER_HEADERS_${l})
        if(NOT EXISTS ${PROJECT_SOURCE_DIR}/include/attnkit/${header})
          message(FATAL_ERROR "attnkit layer ${l}: include/attnkit/${header} does not exist")
        endif()
        attnkit_link_into_view(${view}/attnkit ${PROJECT_SOURCE_DIR}/include/attnkit ${header})
      endforeach()
    endforeach()
  endforeach()
endfunction()

# Every folder of src/ and every public header belongs to exactly one layer,
# so that nothing new escapes the rule by being left out of the table.
function(attnkit_check_layer_table)
  set(owned_folders)
  set(owned_headers)
  foreach(layer IN LISTS ATTNKIT_LAYERS)
    list(APPEND owned_folders ${ATTNKIT_LAYER_FOLDERS_${layer}})
    list(APPEND owned_headers ${ATTNKIT_LAYER_HEADERS_${layer}})
  endforeach()
  file(GLOB_RECURSE files RELATIVE ${PROJECT_SOURCE_DIR}/src CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/src/*.h ${PROJECT_SOURCE_DIR}/src/*.cpp)
  list(REMOVE_ITEM files torch_pch.h)  # the precompiled header, named by path
  foreach(file IN LISTS files)
    set(owner)
    set(path ${file})
    while(path MATCHES "/" AND NOT owner)
      get_filename_component(path ${path} DIRECTORY)
      if(path IN_LIST owned_folders)
        set(owner ${path})
      endif()
    endwhile()
    if(NOT owner)
      message(FATAL_ERROR "src/${file}: its folder belongs to no layer; add it to the layer "
                          "table of CMakeLists.txt")
    endif()
  endforeach()
  file(GLOB_RECURSE headers RELATIVE ${PROJECT_SOURCE_DIR}/include/attnkit CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/include/attnkit/*.h)
  foreach(header IN LISTS headers)
    get_filename_component(folder ${header} DIRECTORY)
    if(NOT header IN_LIST owned_headers AND NOT folder IN_LIST owned_headers)
      message(FATAL_ERROR "include/attnkit/${header} belongs to no layer; add it to the layer "
                          "table of CMakeLists.txt")
    endif()
  endforeach()
endfunction()

# Gives `target` the include root of `layer` (and nothing else of ours).
function(attnkit_layer_includes target layer)
  target_include_directories(${target} PRIVATE ${ATTNKIT_LAYER_VIEWS}/${layer})
endfunction()

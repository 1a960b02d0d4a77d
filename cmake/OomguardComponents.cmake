# The library's components as build targets (sdk/CMakeLists.txt lists them
# and draws the graph).
#
# oomguard_component(<name> [DEPENDS <component>...] SOURCES <file>...)
#   An OBJECT library oomguard_<name>. It links PRIVATE to the components it
#   depends on: their usage requirements reach its compile lines, their
#   objects do not. Public headers come from include/, private ones from the
#   source root.
#
# oomguard_tool(<name> DEPENDS <component>... SOURCES <file>...)
#   An executable oomguard_<name> that sits on top of the components (the
#   `oomguard` tool): built from its sources and the objects of its
#   dependencies' closure, nothing else, so that its link fails on a call into
#   a component it does not declare. scripts/check_layering.py holds its
#   DEPENDS to the same graph as the components'.
#
# oomguard_component_closure(<out> <component>...)
#   The components and every component they depend on, each once.
#
# oomguard_component_sources(<out> <component>...)
#   The absolute source files of the closure (for a build of them with other
#   flags, such as the ThreadSanitizer tests).
#
# oomguard_component_link_libraries(<out> <component>...)
#   The external libraries (imported targets) that the closure links.
#
# oomguard_component_alone(<component>)
#   oomguard_<name>_alone: a shared library of the component and its closure
#   only, linked with --no-undefined, so that a call into a component above
#   it (or into one it does not declare) fails the link and so the build.

function(oomguard_component name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "" "DEPENDS;SOURCES")
  set(target oomguard_${name})
  add_library(${target} OBJECT ${ARG_SOURCES})
  target_include_directories(${target}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  foreach(dep IN LISTS ARG_DEPENDS)
    if(NOT TARGET oomguard_${dep})
      message(FATAL_ERROR "oomguard component ${name} depends on ${dep}, which is not declared before it")
    endif()
    target_link_libraries(${target} PRIVATE oomguard_${dep})
  endforeach()
  set(absolute "")
  foreach(src IN LISTS ARG_SOURCES)
    get_filename_component(abs "${src}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    list(APPEND absolute "${abs}")
  endforeach()
  set_target_properties(${target} PROPERTIES
    OOMGUARD_COMPONENT_DEPENDS "${ARG_DEPENDS}"
    OOMGUARD_COMPONENT_SOURCES "${absolute}")
  set_property(GLOBAL APPEND PROPERTY OOMGUARD_COMPONENTS ${name})
endfunction()

function(oomguard_tool name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "" "DEPENDS;SOURCES")
  set(target oomguard_${name})
  add_executable(${target} ${ARG_SOURCES})
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR})
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  oomguard_component_closure(parts ${ARG_DEPENDS})
  foreach(c IN LISTS parts)
    # Linked directly, so that the objects are part of the executable.
    target_link_libraries(${target} PRIVATE oomguard_${c})
  endforeach()
endfunction()

function(oomguard_component_closure out)
  set(result "")
  set(todo ${ARGN})
  while(todo)
    list(POP_FRONT todo c)
    if(NOT c IN_LIST result)
      list(APPEND result ${c})
      get_target_property(deps oomguard_${c} OOMGUARD_COMPONENT_DEPENDS)
      if(deps)
        list(APPEND todo ${deps})
      endif()
    endif()
  endwhile()
  set(${out} ${result} PARENT_SCOPE)
endfunction()

function(oomguard_component_sources out)
  oomguard_component_closure(parts ${ARGN})
  set(result "")
  foreach(c IN LISTS parts)
    get_target_property(srcs oomguard_${c} OOMGUARD_COMPONENT_SOURCES)
    list(APPEND result ${srcs})
  endforeach()
  set(${out} ${result} PARENT_SCOPE)
endfunction()

function(oomguard_component_link_libraries out)
  oomguard_component_closure(parts ${ARGN})
  get_property(all GLOBAL PROPERTY OOMGUARD_COMPONENTS)
  list(TRANSFORM all PREPEND oomguard_)
  set(result "")
  foreach(c IN LISTS parts)
    get_target_property(libs oomguard_${c} LINK_LIBRARIES)
    foreach(lib IN LISTS libs)
      if(NOT lib IN_LIST all AND NOT lib IN_LIST result)
        list(APPEND result ${lib})
      endif()
    endforeach()
  endforeach()
  set(${out} ${result} PARENT_SCOPE)
endfunction()

function(oomguard_component_alone name)
  oomguard_component_closure(parts ${name})
  set(target oomguard_${name}_alone)
  add_library(${target} SHARED)
  foreach(c IN LISTS parts)
    # Linked directly, so that the objects are part of this library.
    target_link_libraries(${target} PRIVATE oomguard_${c})
  endforeach()
  target_link_options(${target} PRIVATE LINKER:--no-undefined)
  set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/layering)
endfunction()

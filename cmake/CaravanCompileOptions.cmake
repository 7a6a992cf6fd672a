# Warnings and sanitizers live in interface targets so that nothing leaks into global flags
# or into projects that consume Caravan.
add_library(caravan_warnings INTERFACE)
target_compile_options(caravan_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wno-missing-field-initializers>)

add_library(caravan_sanitizers INTERFACE)
if(CARAVAN_SANITIZER STREQUAL "address")
  target_compile_options(caravan_sanitizers INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined>)
  target_link_options(caravan_sanitizers INTERFACE -fsanitize=address,undefined)
elseif(CARAVAN_SANITIZER STREQUAL "thread")
  target_compile_options(caravan_sanitizers INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=thread -fno-omit-frame-pointer>)
  target_link_options(caravan_sanitizers INTERFACE -fsanitize=thread)
elseif(NOT CARAVAN_SANITIZER STREQUAL "")
  message(FATAL_ERROR "CARAVAN_SANITIZER must be 'address', 'thread' or empty, not '${CARAVAN_SANITIZER}'")
endif()

# caravan_add_library(<name> SOURCES ...): a library target caravan_<name> exported as caravan::<name>.
function(caravan_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES" ${ARGN})
  add_library(caravan_${name} ${ARG_SOURCES})
  add_library(caravan::${name} ALIAS caravan_${name})
  set_target_properties(caravan_${name} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME caravan_${name}
                        POSITION_INDEPENDENT_CODE ON)
  target_include_directories(caravan_${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_features(caravan_${name} PUBLIC cxx_std_20)
  target_link_libraries(caravan_${name} PRIVATE $<BUILD_INTERFACE:caravan_warnings>
                                        PUBLIC $<BUILD_INTERFACE:caravan_sanitizers>)
  set_property(GLOBAL APPEND PROPERTY CARAVAN_EXPORTED_TARGETS caravan_${name})
endfunction()

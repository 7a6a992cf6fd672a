include(CMakePackageConfigHelpers)
get_property(caravan_targets GLOBAL PROPERTY CARAVAN_EXPORTED_TARGETS)
install(TARGETS ${caravan_targets} EXPORT caravanTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/caravan DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT caravanTargets NAMESPACE caravan:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/caravan)
configure_package_config_file(cmake/caravanConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/caravanConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/caravan)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/caravanConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/caravanConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/caravanConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/caravan)

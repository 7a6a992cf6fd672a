# Every dependency comes from a Debian 12 package and is used only through its imported target.
# scripts/setup.sh installs them; the list there and here must agree.
find_package(Threads REQUIRED)
find_package(fmt 9 REQUIRED CONFIG)
find_package(spdlog 1.10 REQUIRED CONFIG)
find_package(nlohmann_json 3.11 REQUIRED CONFIG)
find_package(Boost 1.74 REQUIRED CONFIG COMPONENTS graph)
find_package(ucx 1.13 REQUIRED CONFIG)
if(CARAVAN_BUILD_APPS)
  find_package(CLI11 2.1 REQUIRED CONFIG)
endif()
if(CARAVAN_BUILD_TESTS)
  find_package(GTest 1.12 REQUIRED CONFIG)
endif()

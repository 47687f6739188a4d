# The installed package as a user meets it: installs the build in BUILD_DIR under WORK_DIR/prefix,
# configures and builds examples/ (EXAMPLES_DIR) against it with find_package(latentkv), and runs
# the example: on the GPU where there is one (nvidia-smi lists one and the library has its CUDA
# backends: then it must run there), else on the CPU reference.
#   cmake -DBUILD_DIR=... -DEXAMPLES_DIR=... -DWORK_DIR=... [-DGENERATOR=...] [-DCXX_COMPILER=...]
#         [-DCUDA_TOOLKIT_ROOT=...] -P package_test.cmake
foreach(var BUILD_DIR EXAMPLES_DIR WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "package_test.cmake: -D${var}=... is required")
  endif()
endforeach()

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "package test: ${what} failed (${result}): ${ARGN}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
set(configure ${CMAKE_COMMAND} -S ${EXAMPLES_DIR} -B ${WORK_DIR}/build -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
              -DCMAKE_BUILD_TYPE=Release)
if(GENERATOR)
  list(APPEND configure -G ${GENERATOR})
endif()
if(CXX_COMPILER)
  list(APPEND configure -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
if(CUDA_TOOLKIT_ROOT)  # find_package(latentkv) finds the CUDA toolkit the library was built with
  list(APPEND configure -DCUDAToolkit_ROOT=${CUDA_TOOLKIT_ROOT})
endif()
step("configure examples/ against the installed package" ${configure})
step("build examples/" ${CMAKE_COMMAND} --build ${WORK_DIR}/build --config Release)
set(example ${WORK_DIR}/build/dsa_layer)
if(NOT EXISTS ${example})  # a multi-config generator's
  set(example ${WORK_DIR}/build/Release/dsa_layer)
endif()
# A library with the CUDA backends on a machine with a GPU runs the example there, or fails: it does
# not pass quietly on the CPU reference (a driver too old for the runtime would otherwise do that).
set(example_args "")
if(CUDA_TOOLKIT_ROOT)
  execute_process(COMMAND nvidia-smi -L RESULT_VARIABLE smi_result OUTPUT_VARIABLE smi_gpus ERROR_QUIET)
  if(smi_result EQUAL 0 AND smi_gpus MATCHES "GPU [0-9]")
    set(example_args --require-gpu)
  endif()
endif()
step("run examples/dsa_layer" ${example} ${example_args})

# The experiment commands as a user runs them (help, refusals, JSON) with tiny
# sizes: each is listed by `attnkit-experiments --help` and has its own help;
# figure-clustered and approx write JSON whose fields, mechanism names (from
# the registry: "full", never "exact") and identities tie the numbers to the
# mechanisms; approx --run reads a run that attnkit trains. Variables: CLI (the
# attnkit-experiments binary), ATTNKIT (the attnkit binary), TEXT (a small
# text file), OUT_DIR (scratch folder).
include(${CMAKE_CURRENT_LIST_DIR}/../../tests/cli/common.cmake)

file(MAKE_DIRECTORY ${OUT_DIR})
# Help: the tool lists every subcommand, and each has its own help.
require_subcommands(${CLI} attnkit-experiments cloze node-classify figure-agglomerative figure-clustered approx)

# ---------------------------------------------------------------------------
# figure-clustered: the default mechanisms (the registry's full, clustered,
# improved-clustered) over two tiny lengths.
set(fig ${OUT_DIR}/figure-clustered.json)
file(REMOVE ${fig})
run_ok(${CLI} figure-clustered --lengths 64,32 --heads 2 --head-dim 8 --repeats 1 --max-seconds 60
       --threads 1 --json ${fig})
file(READ ${fig} json)
require_no_exact("${json}" "figure-clustered's JSON")
read_fields("${json}" config N H E attention threads load_average_at_start load_average_at_end)
require_length("${json}" 3 "figure-clustered config.attention" config attention)
string(JSON first GET "${json}" config attention 0)
string(JSON improved GET "${json}" config attention 2)
# (Specs with every default written: exact attention's is "full:window=0".)
if(NOT first MATCHES "^full(:window=0)?$" OR NOT improved MATCHES "^improved-clustered:.*topk=32")
  message(FATAL_ERROR "figure-clustered config.attention: '${first}', '${improved}'")
endif()
# 3 mechanisms x 2 lengths.
require_length("${json}" 6 "figure-clustered rows" rows)
set(expected full clustered improved-clustered full clustered improved-clustered)
foreach(i RANGE 5)
  read_fields("${json}" "rows;${i}" attention L ms us_per_element peak_bytes bytes_per_element runs)
  list(GET expected ${i} want)
  if(NOT attention STREQUAL want OR ms LESS_EQUAL 0 OR peak_bytes LESS_EQUAL 0)
    message(FATAL_ERROR "figure-clustered row ${i}: ${attention} (want ${want}) L=${L} ms=${ms} peak=${peak_bytes}")
  endif()
  if(i LESS 3 AND NOT L EQUAL 32)
    message(FATAL_ERROR "figure-clustered: rows not sorted by length (row ${i} has L = ${L})")
  endif()
endforeach()
foreach(m clustered improved-clustered)
  string(JSON crossover ERROR_VARIABLE missing GET "${json}" summary crossover ${m})
  if(missing)
    message(FATAL_ERROR "figure-clustered summary lacks the crossover of ${m}: ${missing}")
  endif()
endforeach()
# Settings come from spec strings; a bad one is refused before any work.
run_refused("accepted: clusters" ${CLI} figure-clustered --attention full,clustered:topk=3)
run_refused("nosuch" ${CLI} figure-clustered --attention nosuch)

# ---------------------------------------------------------------------------
# approx: the default sweep shape over tiny sizes. improved-clustered with
# topk = S attends to every key exactly, so it must equal full attention.
set(approx ${OUT_DIR}/approx.json)
file(REMOVE ${approx})
run_ok(${CLI} approx --length 32 --heads 2 --head-dim 8 --clusters 4,8,64 --topk 4,32,64 --threads 1
       --json ${approx})
file(READ ${approx} json)
require_no_exact("${json}" "approx's JSON")
read_fields("${json}" config H L E centres seed)
# C in {4, 8} (64 > L is left out) x (clustered, improved k = 4, 32; 64 > L
# left out) x 2 input sets.
require_length("${json}" 12 "approx rows" rows)
foreach(i RANGE 11)
  read_fields("${json}" "rows;${i}" inputs attention spec clusters topk rel_err row_l1)
  set(row "approx row ${i} (${spec})")
  if(NOT spec MATCHES "^${attention}:clusters=[48],bits=63,iterations=10")
    message(FATAL_ERROR "${row}: spec does not match attention '${attention}'")
  endif()
  if(attention STREQUAL "clustered")
    if(NOT topk EQUAL 0 OR NOT rel_err GREATER 1e-3 OR NOT row_l1 GREATER 1e-3)
      message(FATAL_ERROR "${row}: clustered with C < L should be off full attention: topk=${topk} rel=${rel_err} l1=${row_l1}")
    endif()
  elseif(attention STREQUAL "improved-clustered" AND topk EQUAL 32)
    if(NOT rel_err LESS 1e-5 OR NOT row_l1 LESS 1e-5)
      message(FATAL_ERROR "${row}: topk = S must equal full attention: rel=${rel_err} l1=${row_l1}")
    endif()
  elseif(NOT (attention STREQUAL "improved-clustered" AND topk EQUAL 4))
    message(FATAL_ERROR "${row}: unexpected row")
  endif()
endforeach()
# Any comparable spec: full itself is full attention to float32 rounding.
run_ok(${CLI} approx --length 16 --heads 1 --head-dim 4 --attention full --threads 1 --json ${approx})
file(READ ${approx} json)
read_fields("${json}" "rows;0" rel_err)
string(JSON clusters TYPE "${json}" rows 0 clusters)
if(NOT rel_err LESS 1e-5 OR NOT clusters STREQUAL "NULL")
  message(FATAL_ERROR "approx --attention full: rel_err ${rel_err}, clusters ${clusters}")
endif()
# --dim, --head-dim's name before the naming pass: the same run, one warning line.
run_ok(${CLI} approx --length 16 --heads 1 --dim 4 --attention full --threads 1 --json ${approx}.old)
if(NOT err STREQUAL "attnkit-experiments approx: --dim is deprecated, use --head-dim (same meaning)\n")
  message(FATAL_ERROR "approx --dim's warning:\n${err}")
endif()
file(READ ${approx}.old old_json)
read_fields("${old_json}" "rows;0" rel_err)
string(JSON old_e GET "${old_json}" config E)
string(JSON new_e GET "${json}" config E)
if(NOT old_e EQUAL 4 OR NOT new_e EQUAL 4)
  message(FATAL_ERROR "approx --dim 4 / --head-dim 4: head dimensions ${old_e}, ${new_e}")
endif()
run_refused("excludes|Excludes" ${CLI} approx --attention clustered --clusters 4)
run_refused("approx compares mechanisms on q, k, v" ${CLI} approx --length 16 --attention agglomerative)
run_refused("every cluster count exceeds" ${CLI} approx --length 16 --clusters 32)

# ---------------------------------------------------------------------------
# approx --run: clustered against full attention on a trained model's own
# queries and keys (a tiny masked-char encoder that attnkit trains here).
set(data ${OUT_DIR}/data)
set(masked ${OUT_DIR}/masked)
file(REMOVE_RECURSE ${data} ${masked})
run_ok(${ATTNKIT} data char-lm --input ${TEXT} --out ${data})
run_ok(${ATTNKIT} train --task masked-char --data ${data} --layers 2 --width 32 --heads 2 --ffn 64 --context 32
       --batch 4 --steps 3 --warmup 1 --eval-batches 1 --seed 2 --threads 1 --out ${masked})
run_ok(${CLI} approx --run ${masked} --sequences 2 --clusters 4 --topk 8 --threads 1 --json ${OUT_DIR}/approx.json)
file(READ ${OUT_DIR}/approx.json json)
read_fields("${json}" "config" H L E)
read_fields("${json}" "model" sequences step)
if(NOT H EQUAL 2 OR NOT L EQUAL 32 OR NOT E EQUAL 16 OR NOT sequences EQUAL 2 OR NOT step EQUAL 3)
  message(FATAL_ERROR "approx --run should take the model's shape: ${json}")
endif()
# Rows: {random, clustered-structure, layer 0, layer 1} x {clustered, improved-clustered}.
string(JSON rows LENGTH "${json}" rows)
read_fields("${json}" "rows;7" inputs row_l1)
if(NOT rows EQUAL 8 OR NOT inputs STREQUAL "layer 1" OR row_l1 LESS 0 OR row_l1 GREATER 2)
  message(FATAL_ERROR "approx --run rows: ${json}")
endif()
run_refused("excludes" ${CLI} approx --run ${masked} --length 64)

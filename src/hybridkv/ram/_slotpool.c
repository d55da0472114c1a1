/* The slot pool's hot path in C: one open-addressing table over an arena of entries, each
 * entry carrying its slot, reference count and the links of the LRU/ARC order it sits in.
 *
 * Why: the Python pool keeps a key in four to six dicts (entries, visibility, the policy's
 * order and ghost lists), so every store cycle on a large pool pays a dozen dict probes,
 * each a cache miss, plus interpreter overhead. Here a key is one table bucket and one
 * 40-byte entry, and a lookup reads only the bucket (which holds the key pointer and the
 * answer) and the key itself: two cache misses on a large pool. Semantics are exactly those of ram/pool.py + ram/policies.py (LRU and ARC,
 * same victims, same slot order; tests/ram/test_compiled_pool.py runs both side by side).
 * compiled_pool.py wraps this type; pool.make_pool falls back to Python without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

enum { POLICY_LRU = 0, POLICY_ARC = 1 };
enum { T1 = 0, T2 = 1, B1 = 2, B2 = 3, NO_LIST = -1 };
/* where an entry is: free, resident in T1 (all LRU keys) or T2, or a ghost in B1 or B2 */
enum { FREE = 0, IN_T1 = 1, IN_T2 = 2, GHOST_B1 = 3, GHOST_B2 = 4 };
#define WRITE_PENDING (-1)
#define EMPTY (-1)

typedef struct {
    PyObject *key;          /* owned; NULL when free */
    Py_hash_t hash;
    int32_t slot;
    int32_t refs;           /* WRITE_PENDING, 0 = evictable, > 0 = pins */
    int32_t prev, next;     /* links in `list`; `next` also chains free entries */
    int8_t list;            /* T1..B2 or NO_LIST */
    int8_t where;
    int8_t cold;            /* stored cold: re-enters its list at the evicted-first end */
    uint32_t mark;          /* == pool->mark: one of the current call's keys */
    uint64_t stamp;         /* when it last became most recent (`recency`); 0: at the front */
} Entry;

/* One clock for every pool of the process (policies.RECENCY): pools sharing one budget
   compare the stamps of their least recently used pages. */
static uint64_t recency = 0;

/* A bucket answers a lookup by itself (key compare + answer bits): the entry is not read. */
typedef struct {
    PyObject *key;          /* the entry's key (the entry owns the reference) */
    int32_t id;             /* entry index or EMPTY */
    uint32_t h;             /* bits 0-29: folded hash; 30-31: what a lookup answers */
} Bucket;

#define HASH_BITS 0x3FFFFFFFu
#define ANSWER_SHIFT 30
enum { ANSWER_MISS = 0, ANSWER_HIT = 1, ANSWER_PENDING = 2 };   /* MISS: an ARC ghost */

typedef struct {
    PyObject_HEAD
    int policy;
    Py_ssize_t capacity;
    PyObject *group_id;
    Entry *e;
    int32_t n_entries, free_entry;
    Bucket *table;
    int bits;
    Py_ssize_t used;        /* entries in the table (resident + ghosts) */
    int32_t *free_slots;    /* grown with `fresh`: a pool of a billion slots costs what it uses */
    Py_ssize_t n_free, free_cap, fresh;
    int32_t head[4], tail[4];
    Py_ssize_t len[4];
    Py_ssize_t resident, size1, size2;  /* size1/size2: ARC's resident keys per list */
    double target_t1;
    uint32_t mark;
    long long stores, failed_stores, evictions, store_refusals;
} Pool;

/* Set once by bind(): the Python values this module hands out. */
static PyObject *MISS, *HIT, *HIT_PENDING, *PLAN;

/* ---- the table ------------------------------------------------------------------------ */

static inline uint32_t fold(Py_hash_t hash) {
    uint64_t h = (uint64_t)hash;
    return (uint32_t)(h ^ (h >> 32)) & HASH_BITS;
}

static inline size_t home(const Pool *p, uint32_t h) {
    return (size_t)((uint32_t)((h & HASH_BITS) * 2654435769u) >> (32 - p->bits));
}

static inline void set_answer(Pool *p, Py_ssize_t bucket, int answer) {
    p->table[bucket].h = (p->table[bucket].h & HASH_BITS) | ((uint32_t)answer << ANSWER_SHIFT);
}

/* Bucket index holding key, or -1 (absent), or -2 (comparison raised). */
static Py_ssize_t find(Pool *p, PyObject *key, Py_hash_t hash) {
    uint32_t h = fold(hash);
    size_t mask = ((size_t)1 << p->bits) - 1, i = home(p, h);
    for (;;) {
        Bucket *b = &p->table[i];
        if (b->id == EMPTY)
            return -1;
        if ((b->h & HASH_BITS) == h) {
            if (b->key == key)
                return (Py_ssize_t)i;
            int eq = PyObject_RichCompareBool(b->key, key, Py_EQ);
            if (eq < 0)
                return -2;
            if (eq)
                return (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
}

/* Bucket of a key (resident or ghost), -1 when absent, -2 on error. */
static Py_ssize_t bucket_of(Pool *p, PyObject *key) {
    Py_hash_t hash = PyObject_Hash(key);
    return hash == -1 ? -2 : find(p, key, hash);
}

/* Entry id of a key (resident or ghost), -1 when absent, -2 on error. */
static int32_t entry_of(Pool *p, PyObject *key) {
    Py_ssize_t b = bucket_of(p, key);
    return b < 0 ? (int32_t)b : p->table[b].id;
}

static inline int resident(const Entry *en) { return en->where == IN_T1 || en->where == IN_T2; }

/* Bucket of a resident key, -1 when not resident, -2 on error. */
static Py_ssize_t resident_bucket(Pool *p, PyObject *key) {
    Py_ssize_t b = bucket_of(p, key);
    return (b >= 0 && !resident(&p->e[p->table[b].id])) ? -1 : b;
}

/* Resident entry id of key, -1 when not resident, -2 on error. */
static int32_t resident_of(Pool *p, PyObject *key) {
    Py_ssize_t b = resident_bucket(p, key);
    return b < 0 ? (int32_t)b : p->table[b].id;
}

static void place(Pool *p, Bucket b) {
    size_t mask = ((size_t)1 << p->bits) - 1, i = home(p, b.h);
    while (p->table[i].id != EMPTY)
        i = (i + 1) & mask;
    p->table[i] = b;
    p->used++;
}

/* Linear-probing delete by backward shift: no tombstones, probes stay short. */
static void take_out(Pool *p, PyObject *key, Py_hash_t hash) {
    Py_ssize_t found = find(p, key, hash);  /* identity hit first: cannot raise */
    size_t mask = ((size_t)1 << p->bits) - 1, i = (size_t)found, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (p->table[j].id == EMPTY)
            break;
        size_t k = home(p, p->table[j].h);
        if (i <= j ? (k <= i || k > j) : (k <= i && k > j)) {
            p->table[i] = p->table[j];
            i = j;
        }
    }
    p->table[i].id = EMPTY;
    p->used--;
}

static int resize_table(Pool *p, int bits) {
    Bucket *old = p->table;
    size_t old_n = old ? (size_t)1 << p->bits : 0;
    Bucket *t = PyMem_Malloc(sizeof(Bucket) << bits);
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < ((size_t)1 << bits); i++)
        t[i].id = EMPTY;
    p->table = t;
    p->bits = bits;
    p->used = 0;
    for (size_t i = 0; i < old_n; i++)
        if (old[i].id != EMPTY)
            place(p, old[i]);
    PyMem_Free(old);
    return 0;
}

/* Room for `more` new entries: arena and table grow (doubling) before anything changes. */
static int reserve(Pool *p, Py_ssize_t more) {
    Py_ssize_t need = p->used + more;
    int bits = p->bits;
    while (((Py_ssize_t)1 << bits) < 2 * need)
        bits++;
    if (bits > 32) {
        PyErr_SetString(PyExc_OverflowError, "slot pool: too many entries");
        return -1;
    }
    if (bits != p->bits && resize_table(p, bits) < 0)
        return -1;
    if (p->fresh + more > p->free_cap) {   /* every slot ever handed out may come back */
        Py_ssize_t cap = p->free_cap ? p->free_cap : 16;
        while (cap < p->fresh + more)
            cap *= 2;
        int32_t *slots = PyMem_Realloc(p->free_slots, sizeof(int32_t) * (size_t)cap);
        if (slots == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        p->free_slots = slots;
        p->free_cap = cap;
    }
    Py_ssize_t free_n = p->n_entries - p->used;   /* every live entry holds one bucket */
    if (free_n >= more)
        return 0;
    Py_ssize_t n = p->n_entries ? p->n_entries : 16;
    while (n < p->n_entries + (more - free_n))
        n *= 2;
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "slot pool: too many entries");
        return -1;
    }
    Entry *e = PyMem_Realloc(p->e, sizeof(Entry) * (size_t)n);
    if (e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    p->e = e;
    for (int32_t i = (int32_t)n - 1; i >= p->n_entries; i--) {
        e[i].key = NULL;
        e[i].where = FREE;
        e[i].mark = 0;
        e[i].next = p->free_entry;
        p->free_entry = i;
    }
    p->n_entries = (int32_t)n;
    return 0;
}

/* A new entry for key (space reserved beforehand); not in any list. */
static int32_t add_entry(Pool *p, PyObject *key, Py_hash_t hash) {
    int32_t id = p->free_entry;
    Entry *en = &p->e[id];
    p->free_entry = en->next;
    Py_INCREF(key);
    en->key = key;
    en->hash = hash;
    en->list = NO_LIST;
    en->prev = en->next = EMPTY;
    place(p, (Bucket){key, id, fold(hash) | ((uint32_t)ANSWER_PENDING << ANSWER_SHIFT)});
    return id;
}

static void drop_entry(Pool *p, int32_t id) {
    Entry *en = &p->e[id];
    take_out(p, en->key, en->hash);
    Py_CLEAR(en->key);
    en->where = FREE;
    en->next = p->free_entry;
    p->free_entry = id;
}

/* ---- intrusive lists ------------------------------------------------------------------ */

/* Link an entry into list l just before entry `at` (EMPTY: at the back, the most recent end). */
static void insert_before(Pool *p, int l, int32_t id, int32_t at) {
    Entry *en = &p->e[id];
    int32_t prev = at == EMPTY ? p->tail[l] : p->e[at].prev;
    en->list = (int8_t)l;
    en->prev = prev;
    en->next = at;
    if (prev != EMPTY)
        p->e[prev].next = id;
    else
        p->head[l] = id;
    if (at != EMPTY)
        p->e[at].prev = id;
    else
        p->tail[l] = id;
    p->len[l]++;
}

static void push_back(Pool *p, int l, int32_t id) {
    p->e[id].stamp = ++recency;
    insert_before(p, l, id, EMPTY);
}

static void push_front(Pool *p, int l, int32_t id) {
    p->e[id].stamp = 0;
    insert_before(p, l, id, p->head[l]);
}

static void unlink_entry(Pool *p, int32_t id) {
    Entry *en = &p->e[id];
    int l = en->list;
    if (l == NO_LIST)
        return;
    if (en->prev != EMPTY)
        p->e[en->prev].next = en->next;
    else
        p->head[l] = en->next;
    if (en->next != EMPTY)
        p->e[en->next].prev = en->prev;
    else
        p->tail[l] = en->prev;
    en->list = NO_LIST;
    p->len[l]--;
}

static inline void move_to_back(Pool *p, int32_t id) {
    int l = p->e[id].list;
    if (p->tail[l] != id) {
        unlink_entry(p, id);
        push_back(p, l, id);
    } else {
        p->e[id].stamp = ++recency;
    }
}

/* ---- policy: what ram/policies.py does, on entries ------------------------------------ */

static void set_evictable(Pool *p, int32_t id) {
    (p->e[id].cold ? push_front : push_back)(p, p->e[id].where == IN_T2 ? T2 : T1, id);
}

static Py_ssize_t evictable_count(const Pool *p) { return p->len[T1] + p->len[T2]; }

/* A resident key gives up its slot and leaves its list; the entry stays (see callers). */
static void leave_residence(Pool *p, int32_t id) {
    Entry *en = &p->e[id];
    unlink_entry(p, id);
    if (en->where == IN_T1)
        p->size1--;
    else
        p->size2--;
    p->free_slots[p->n_free++] = en->slot;
    p->resident--;
}

/* Forget a resident key for good (failed store, reset, LRU eviction). */
static void remove_resident(Pool *p, int32_t id) {
    leave_residence(p, id);
    drop_entry(p, id);
}

/* An evicted key: gone under LRU, a ghost under ARC (its list capped at capacity). */
static void evict_entry(Pool *p, int32_t id) {
    if (p->policy == POLICY_LRU) {
        remove_resident(p, id);
        return;
    }
    Entry *en = &p->e[id];
    int ghosts = en->where == IN_T1 ? B1 : B2;
    leave_residence(p, id);
    en->where = ghosts == B1 ? GHOST_B1 : GHOST_B2;
    en->slot = -1;
    set_answer(p, find(p, en->key, en->hash), ANSWER_MISS);   /* an identity hit */
    push_back(p, ghosts, id);
    if (p->len[ghosts] > p->capacity) {
        int32_t oldest = p->head[ghosts];
        unlink_entry(p, oldest);
        drop_entry(p, oldest);
    }
}

/* A new mark: no key is marked any more. */
static void new_mark(Pool *p) {
    if (++p->mark == 0) {
        for (int32_t i = 0; i < p->n_entries; i++)
            p->e[i].mark = 0;
        p->mark = 1;
    }
}

/* Mark the call's keys (they are never victims). Returns how many distinct marked keys are
 * evictable (what can_place must not count on), or -1 on error. */
static Py_ssize_t mark_keys(Pool *p, PyObject *fast) {
    new_mark(p);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), evictable = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t id = entry_of(p, items[i]);
        if (id == -2)
            return -1;
        if (id < 0 || p->e[id].mark == p->mark)
            continue;
        p->e[id].mark = p->mark;
        if (resident(&p->e[id]) && p->e[id].list != NO_LIST)
            evictable++;
    }
    return evictable;
}

/* First unmarked evictable entry at or after *cursor in its list, advancing the cursor. */
static int32_t take_from(Pool *p, int32_t *cursor) {
    while (*cursor != EMPTY) {
        int32_t id = *cursor;
        *cursor = p->e[id].next;
        if (p->e[id].mark != p->mark)
            return id;
    }
    return EMPTY;
}

/* Choose n victims not among the marked keys; all or nothing. Fills ids; 0 = none. */
static int choose_victims(Pool *p, Py_ssize_t n, int32_t *ids) {
    if (evictable_count(p) < n)
        return 0;
    int32_t c1 = p->head[T1], c2 = p->head[T2];
    Py_ssize_t t1_size = p->size1;
    for (Py_ssize_t got = 0; got < n; got++) {
        int prefer_t1 = p->policy == POLICY_LRU || (double)t1_size >= (p->target_t1 > 1.0 ? p->target_t1 : 1.0);
        int32_t id = take_from(p, prefer_t1 ? &c1 : &c2);
        if (id == EMPTY)
            id = take_from(p, prefer_t1 ? &c2 : &c1);
        if (id == EMPTY)
            return 0;
        if (p->e[id].where == IN_T1)
            t1_size--;
        ids[got] = id;
    }
    return 1;
}

/* A key being stored: new, or an ARC ghost coming back (which adapts the T1 target). */
static int32_t insert_key(Pool *p, PyObject *key, Py_hash_t hash, int32_t slot) {
    int32_t id = EMPTY;
    int8_t where = IN_T1;
    if (p->policy == POLICY_ARC) {
        Py_ssize_t b = find(p, key, hash);
        if (b >= 0) {
            id = p->table[b].id;
            Py_ssize_t n1 = p->len[B1], n2 = p->len[B2];
            if (p->e[id].where == GHOST_B1) {
                double step = (double)n2 / (double)n1;
                p->target_t1 += step > 1.0 ? step : 1.0;
                if (p->target_t1 > (double)p->capacity)
                    p->target_t1 = (double)p->capacity;
            } else {
                double step = (double)n1 / (double)n2;
                p->target_t1 -= step > 1.0 ? step : 1.0;
                if (p->target_t1 < 0.0)
                    p->target_t1 = 0.0;
            }
            unlink_entry(p, id);
            where = IN_T2;
            set_answer(p, b, ANSWER_PENDING);   /* the ghost's key object stays: it is equal */
        }
    }
    if (id == EMPTY)
        id = add_entry(p, key, hash);
    Entry *en = &p->e[id];
    en->where = where;
    en->cold = 0;
    en->slot = slot;
    en->refs = WRITE_PENDING;
    if (where == IN_T1)
        p->size1++;
    else
        p->size2++;
    p->resident++;
    return id;
}

/* ---- helpers -------------------------------------------------------------------------- */

static PyObject *fast(PyObject *keys) {
    return PySequence_Fast(keys, "slot pool: keys must be a sequence");
}

/* Parses (keys[, second]) with the second also accepted by keyword `name`. */
static int two_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                    const char *name, PyObject **first, PyObject **second) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs < 1 || nargs + nkw > 2) {
        PyErr_Format(PyExc_TypeError, "expected (keys, %s=...)", name);
        return -1;
    }
    *first = args[0];
    if (nargs == 2)
        *second = args[1];
    else if (nkw == 1) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(kwnames, 0)) ||
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), name) != 0) {
            PyErr_Format(PyExc_TypeError, "unexpected keyword; expected %s", name);
            return -1;
        }
        *second = args[1];
    }
    return 0;
}

/* ---- methods -------------------------------------------------------------------------- */

static PyObject *Pool_lookup(Pool *p, PyObject *key) {
    Py_ssize_t b = bucket_of(p, key);
    if (b == -2)
        return NULL;
    if (b < 0)
        return Py_NewRef(MISS);
    uint32_t answer = p->table[b].h >> ANSWER_SHIFT;
    return Py_NewRef(answer == ANSWER_HIT ? HIT : answer == ANSWER_PENDING ? HIT_PENDING : MISS);
}

/* Calls fn on the entry of every resident key of `keys`, the last key first if `backwards`. */
static PyObject *each_resident(Pool *p, PyObject *keys, int backwards, void (*fn)(Pool *, int32_t)) {
    PyObject *f = fast(keys);
    if (f == NULL)
        return NULL;
    PyObject **items = PySequence_Fast_ITEMS(f);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    for (Py_ssize_t k = 0; k < n; k++) {
        int32_t id = resident_of(p, items[backwards ? n - 1 - k : k]);
        if (id == -2) {
            Py_DECREF(f);
            return NULL;
        }
        if (id >= 0)
            fn(p, id);
    }
    Py_DECREF(f);
    Py_RETURN_NONE;
}

static void touch_entry(Pool *p, int32_t id) {
    Entry *en = &p->e[id];
    en->cold = 0;            /* used: it re-enters its list as any page does */
    if (en->where == IN_T1 && p->policy == POLICY_ARC) {   /* seen again: T1 -> T2 */
        en->where = IN_T2;
        p->size1--;
        p->size2++;
        if (en->list == T1) {
            unlink_entry(p, id);
            push_back(p, T2, id);
        }
    } else if (en->list != NO_LIST) {
        move_to_back(p, id);
    }
}

static void mark_cold_entry(Pool *p, int32_t id) {
    int l = p->e[id].list;
    p->e[id].cold = 1;
    if (l != NO_LIST) {      /* evictable now: to the front of its list at once */
        unlink_entry(p, id);
        push_front(p, l, id);
    }
}

/* Keys of one request in prefix order: the prefix ends up most recent (last key first); a
   page stored cold is an ordinary one from its first use. */
static PyObject *Pool_touch(Pool *p, PyObject *keys) { return each_resident(p, keys, 1, touch_entry); }

static PyObject *Pool_mark_cold(Pool *p, PyObject *keys) { return each_resident(p, keys, 0, mark_cold_entry); }

/* Keys not resident or in flight, first occurrence only (list). */
static PyObject *new_keys_of(Pool *p, PyObject *f) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    PyObject **items = PySequence_Fast_ITEMS(f);
    PyObject *out = PyList_New(0), *seen = NULL;
    if (out == NULL)
        return NULL;
    if (n > 1 && (seen = PySet_New(NULL)) == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t id = resident_of(p, items[i]);
        if (id == -2)
            goto fail;
        if (id >= 0)
            continue;
        if (seen != NULL) {
            int dup = PySet_Contains(seen, items[i]);
            if (dup < 0 || (!dup && PySet_Add(seen, items[i]) < 0))
                goto fail;
            if (dup)
                continue;
        }
        if (PyList_Append(out, items[i]) < 0)
            goto fail;
    }
    Py_XDECREF(seen);
    return out;
fail:
    Py_XDECREF(seen);
    Py_DECREF(out);
    return NULL;
}

static PyObject *Pool_new_keys(Pool *p, PyObject *keys) {
    PyObject *f = fast(keys);
    if (f == NULL)
        return NULL;
    PyObject *out = new_keys_of(p, f);
    Py_DECREF(f);
    return out;
}

static Py_ssize_t free_count(const Pool *p) { return p->n_free + p->capacity - p->fresh; }

static PyObject *Pool_can_place(Pool *p, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *keys, *new_ = Py_None;
    if (two_args(args, nargs, kwnames, "new", &keys, &new_) < 0)
        return NULL;
    PyObject *f = fast(keys), *nf = NULL;
    if (f == NULL)
        return NULL;
    nf = new_ == Py_None ? new_keys_of(p, f) : fast(new_);
    if (nf == NULL) {
        Py_DECREF(f);
        return NULL;
    }
    Py_ssize_t need = PySequence_Fast_GET_SIZE(nf) - free_count(p);
    Py_DECREF(nf);
    if (need <= 0) {
        Py_DECREF(f);
        Py_RETURN_TRUE;
    }
    Py_ssize_t protected_evictable = mark_keys(p, f);
    Py_DECREF(f);
    if (protected_evictable < 0)
        return NULL;
    return PyBool_FromLong(evictable_count(p) - protected_evictable >= need);
}

static PyObject *Pool_prepare_store(Pool *p, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *keys, *new_ = Py_None, *f, *nf = NULL, *slots = NULL, *evicted = NULL, *plan = NULL;
    int32_t *victims = NULL;
    if (two_args(args, nargs, kwnames, "new", &keys, &new_) < 0)
        return NULL;
    if ((f = fast(keys)) == NULL)
        return NULL;
    if (new_ == Py_None) {
        nf = new_keys_of(p, f);
    } else {   /* the caller's new_keys(keys): checked, nothing changes if it is stale */
        nf = PySequence_List(new_);
        for (Py_ssize_t i = 0; nf != NULL && i < PyList_GET_SIZE(nf); i++) {
            int32_t id = resident_of(p, PyList_GET_ITEM(nf, i));
            if (id != -1) {
                if (id >= 0)
                    PyErr_SetString(PyExc_ValueError, "prepare_store: a key of `new` is already resident");
                Py_CLEAR(nf);
            }
        }
        if (nf != NULL && PyList_GET_SIZE(nf) > 1) {
            PyObject *distinct = PySet_New(nf);
            Py_ssize_t n_distinct = distinct ? PySet_GET_SIZE(distinct) : -1;
            Py_XDECREF(distinct);
            if (n_distinct != PyList_GET_SIZE(nf)) {
                if (n_distinct >= 0)
                    PyErr_SetString(PyExc_ValueError, "prepare_store: `new` repeats a key");
                Py_CLEAR(nf);
            }
        }
    }
    if (nf == NULL)
        goto done;
    Py_ssize_t n_new = PyList_GET_SIZE(nf);
    if ((evicted = PyList_New(0)) == NULL || (slots = PyList_New(n_new)) == NULL)
        goto done;
    if (n_new == 0) {
        plan = PyObject_CallFunctionObjArgs(PLAN, nf, slots, evicted, NULL);
        goto done;
    }
    if (reserve(p, n_new) < 0)
        goto done;
    Py_ssize_t need = n_new - free_count(p);
    if (need > 0) {
        if (mark_keys(p, f) < 0 || (victims = PyMem_Malloc(sizeof(int32_t) * need)) == NULL) {
            if (!PyErr_Occurred())
                PyErr_NoMemory();
            goto done;
        }
        if (!choose_victims(p, need, victims)) {
            p->store_refusals++;
            plan = Py_NewRef(Py_None);
            goto done;
        }
        for (Py_ssize_t i = 0; i < need; i++)   /* list first: evicting may drop the key */
            if (PyList_Append(evicted, p->e[victims[i]].key) < 0)
                goto done;
        for (Py_ssize_t i = 0; i < need; i++)
            evict_entry(p, victims[i]);
        p->evictions += need;
    }
    for (Py_ssize_t i = 0; i < n_new; i++) {
        PyObject *key = PyList_GET_ITEM(nf, i);
        int32_t slot = p->n_free ? p->free_slots[--p->n_free] : (int32_t)p->fresh++;
        PyObject *s = PyLong_FromLong(slot);
        if (s == NULL)
            goto done;
        PyList_SET_ITEM(slots, i, s);
        insert_key(p, key, PyObject_Hash(key), slot);   /* hashed already: cannot fail */
    }
    plan = PyObject_CallFunctionObjArgs(PLAN, nf, slots, evicted, NULL);
done:
    PyMem_Free(victims);
    Py_DECREF(f);
    Py_XDECREF(nf);
    Py_XDECREF(slots);
    Py_XDECREF(evicted);
    return plan;
}

static PyObject *Pool_complete_store(Pool *p, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *keys, *success_obj = Py_True;
    if (two_args(args, nargs, kwnames, "success", &keys, &success_obj) < 0)
        return NULL;
    int success = PyObject_IsTrue(success_obj);
    PyObject *f;
    if (success < 0 || (f = fast(keys)) == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f), done_n = 0;
    PyObject **items = PySequence_Fast_ITEMS(f);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t b = resident_bucket(p, items[i]);
        if (b == -2)
            goto fail;
        if (b < 0 || p->e[p->table[b].id].refs != WRITE_PENDING)
            continue;
        int32_t id = p->table[b].id;
        if (success) {
            p->e[id].refs = 0;
            set_answer(p, b, ANSWER_HIT);
            set_evictable(p, id);
        } else {
            remove_resident(p, id);
        }
        done_n++;
    }
    if (success)
        p->stores += done_n;
    else
        p->failed_stores += done_n;
    Py_DECREF(f);
    Py_RETURN_NONE;
fail:
    Py_DECREF(f);
    return NULL;
}

static PyObject *Pool_prepare_load(Pool *p, PyObject *keys) {
    PyObject *f = fast(keys), *slots = NULL;
    if (f == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    PyObject **items = PySequence_Fast_ITEMS(f);
    int32_t *ids = PyMem_Malloc(sizeof(int32_t) * (n ? n : 1));
    if (ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {   /* all loadable, or nothing is pinned */
        ids[i] = resident_of(p, items[i]);
        if (ids[i] == -2)
            goto done;
        if (ids[i] < 0 || p->e[ids[i]].refs == WRITE_PENDING) {
            PyErr_Format(PyExc_KeyError, "group %S: key is not loadable", p->group_id);
            goto done;
        }
    }
    if ((slots = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {   /* the list first: nothing can fail once pins start */
        PyObject *s = PyLong_FromLong(p->e[ids[i]].slot);
        if (s == NULL) {
            Py_CLEAR(slots);
            goto done;
        }
        PyList_SET_ITEM(slots, i, s);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (p->e[ids[i]].refs++ == 0)
            unlink_entry(p, ids[i]);
done:
    PyMem_Free(ids);
    Py_DECREF(f);
    return slots;
}

static PyObject *Pool_complete_load(Pool *p, PyObject *keys) {
    PyObject *f = fast(keys);
    if (f == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    PyObject **items = PySequence_Fast_ITEMS(f);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t id = resident_of(p, items[i]);
        if (id < 0) {
            if (id == -1)
                PyErr_SetObject(PyExc_KeyError, items[i]);
            Py_DECREF(f);
            return NULL;
        }
        if (p->e[id].refs <= 0) {
            PyErr_Format(PyExc_ValueError, "group %S: complete_load without prepare_load", p->group_id);
            Py_DECREF(f);
            return NULL;
        }
        if (--p->e[id].refs == 0)
            set_evictable(p, id);
    }
    Py_DECREF(f);
    Py_RETURN_NONE;
}

static PyObject *Pool_reset(Pool *p, PyObject *Py_UNUSED(ignored)) {
    for (int32_t id = 0; id < p->n_entries; id++)
        if (resident(&p->e[id]) && p->e[id].refs == 0)
            remove_resident(p, id);
    Py_RETURN_NONE;
}

static PyObject *Pool_resident_keys(Pool *p, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    for (int32_t id = 0; out != NULL && id < p->n_entries; id++)
        if (resident(&p->e[id]) && PyList_Append(out, p->e[id].key) < 0)
            Py_CLEAR(out);
    return out;
}

/* ---- a budget shared with other pools (pool.py: oldest, evict_lru, set_capacity) -------- */

static int lru_only(const Pool *p) {
    if (p->policy == POLICY_LRU)
        return 1;
    PyErr_SetString(PyExc_NotImplementedError, "recency stamps are kept under LRU only");
    return 0;
}

static PyObject *Pool_oldest(Pool *p, PyObject *Py_UNUSED(ignored)) {
    if (!lru_only(p))
        return NULL;
    if (p->head[T1] == EMPTY)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(p->e[p->head[T1]].stamp);
}

static PyObject *Pool_older_than(Pool *p, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long stamp;
    Py_ssize_t limit, n = 0;
    if (!_PyArg_CheckPositional("older_than", nargs, 2, 2))
        return NULL;
    stamp = PyLong_AsUnsignedLongLong(args[0]);
    if (stamp == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    limit = PyLong_AsSsize_t(args[1]);
    if ((limit == -1 && PyErr_Occurred()) || !lru_only(p))
        return NULL;
    for (int32_t id = p->head[T1]; id != EMPTY && n < limit && p->e[id].stamp < stamp; id = p->e[id].next)
        n++;
    return PyLong_FromSsize_t(n);
}

static PyObject *Pool_evict_lru(Pool *p, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL || n <= 0)
        return out;
    int32_t *ids = PyMem_Malloc(sizeof(int32_t) * (size_t)n);
    if (ids == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    new_mark(p);                     /* no key is protected */
    if (!choose_victims(p, n, ids)) {
        PyMem_Free(ids);
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < n; i++)   /* list first: evicting may drop the key */
        if (PyList_Append(out, p->e[ids[i]].key) < 0) {
            PyMem_Free(ids);
            Py_DECREF(out);
            return NULL;
        }
    for (Py_ssize_t i = 0; i < n; i++)
        evict_entry(p, ids[i]);
    p->evictions += n;
    PyMem_Free(ids);
    return out;
}

typedef struct { int32_t slot, id; } SlotOf;

static int by_slot(const void *a, const void *b) {
    int32_t x = ((const SlotOf *)a)->slot, y = ((const SlotOf *)b)->slot;
    return (x > y) - (x < y);
}

static int ascending(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Grow, or shrink moving the pages past the new end to the lowest free slots below it. */
static PyObject *Pool_set_capacity(Pool *p, PyObject *arg) {
    Py_ssize_t cap = PyLong_AsSsize_t(arg);
    if (cap == -1 && PyErr_Occurred())
        return NULL;
    if (cap <= 0 || cap > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "group %R: a pool needs at least one slot", p->group_id);
        return NULL;
    }
    if (p->fresh <= cap) {          /* no slot past the end was ever handed out */
        p->capacity = cap;
        return PyList_New(0);
    }
    Py_ssize_t n_above = 0, n_below = 0;
    for (int32_t i = 0; i < p->n_entries; i++) {
        const Entry *en = &p->e[i];
        if (resident(en) && en->slot >= cap) {
            if (en->refs != 0)
                Py_RETURN_NONE;     /* pinned or being written: it cannot move */
            n_above++;
        }
    }
    for (Py_ssize_t i = 0; i < p->n_free; i++)
        n_below += p->free_slots[i] < cap;
    if (n_above > n_below)
        Py_RETURN_NONE;
    SlotOf *above = PyMem_Malloc(sizeof(SlotOf) * (size_t)(n_above ? n_above : 1));
    int32_t *below = PyMem_Malloc(sizeof(int32_t) * (size_t)(n_below ? n_below : 1));
    PyObject *moves = PyList_New(n_above);
    if (above == NULL || below == NULL || moves == NULL) {
        if (moves != NULL)
            PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t k = 0;
    for (int32_t i = 0; i < p->n_entries; i++)
        if (resident(&p->e[i]) && p->e[i].slot >= cap)
            above[k++] = (SlotOf){p->e[i].slot, i};
    qsort(above, (size_t)n_above, sizeof(SlotOf), by_slot);
    k = 0;
    for (Py_ssize_t i = 0; i < p->n_free; i++)
        if (p->free_slots[i] < cap)
            below[k++] = p->free_slots[i];
    qsort(below, (size_t)n_below, sizeof(int32_t), ascending);
    for (Py_ssize_t i = 0; i < n_above; i++) {     /* built whole before anything changes */
        PyObject *move = Py_BuildValue("(Oii)", p->e[above[i].id].key, above[i].slot, below[i]);
        if (move == NULL)
            goto fail;
        PyList_SET_ITEM(moves, i, move);
    }
    for (Py_ssize_t i = 0; i < n_above; i++)
        p->e[above[i].id].slot = below[i];
    memcpy(p->free_slots, below + n_above, sizeof(int32_t) * (size_t)(n_below - n_above));
    p->n_free = n_below - n_above;
    if (p->fresh > cap)
        p->fresh = cap;
    p->capacity = cap;
    PyMem_Free(above);
    PyMem_Free(below);
    return moves;
fail:
    PyMem_Free(above);
    PyMem_Free(below);
    Py_XDECREF(moves);
    return NULL;
}

static PyObject *Pool_free_count(Pool *p, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSsize_t(free_count(p));
}

static PyObject *Pool_evictable_count(Pool *p, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSsize_t(evictable_count(p));
}

static PyObject *Pool_slot_of(Pool *p, PyObject *key) {
    int32_t id = resident_of(p, key);
    if (id == -1)
        PyErr_SetObject(PyExc_KeyError, key);
    return id < 0 ? NULL : PyLong_FromLong(p->e[id].slot);
}

static PyObject *Pool_refs_of(Pool *p, PyObject *key) {
    int32_t id = resident_of(p, key);
    if (id == -2)
        return NULL;
    return id < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(p->e[id].refs);
}

static Py_ssize_t Pool_len(Pool *p) { return p->resident; }

static int Pool_contains(Pool *p, PyObject *key) {
    int32_t id = resident_of(p, key);
    return id == -2 ? -1 : id >= 0;
}

/* ---- type ----------------------------------------------------------------------------- */

static int Pool_init(Pool *p, PyObject *args, PyObject *kwds) {
    static char *names[] = {"group_id", "capacity", "policy", NULL};
    PyObject *group_id;
    Py_ssize_t capacity;
    const char *policy = "lru";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On|s", names, &group_id, &capacity, &policy))
        return -1;
    if (MISS == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_slotpool.bind() was not called (import hybridkv.ram.compiled_pool)");
        return -1;
    }
    if (p->e != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a slot pool is initialised once");
        return -1;
    }
    if (capacity <= 0) {
        PyErr_Format(PyExc_ValueError, "group %S: a pool needs at least one slot", group_id);
        return -1;
    }
    if (strcmp(policy, "lru") == 0)
        p->policy = POLICY_LRU;
    else if (strcmp(policy, "arc") == 0)
        p->policy = POLICY_ARC;
    else {
        PyErr_Format(PyExc_ValueError, "unknown eviction policy '%s' for the compiled pool; use 'lru' or 'arc'", policy);
        return -1;
    }
    p->capacity = capacity;
    p->group_id = Py_NewRef(group_id);
    p->free_entry = EMPTY;
    for (int l = 0; l < 4; l++)
        p->head[l] = p->tail[l] = EMPTY;
    if (resize_table(p, 4) < 0 || reserve(p, 1) < 0) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Pool_dealloc(Pool *p) {
    for (int32_t i = 0; i < p->n_entries; i++)
        Py_XDECREF(p->e[i].key);
    PyMem_Free(p->e);
    PyMem_Free(p->table);
    PyMem_Free(p->free_slots);
    Py_XDECREF(p->group_id);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef Pool_methods[] = {
    {"lookup", (PyCFunction)Pool_lookup, METH_O, "key -> MISS, HIT or HIT_PENDING"},
    {"touch", (PyCFunction)Pool_touch, METH_O, "keys of one request, prefix order: make them most recent"},
    {"mark_cold", (PyCFunction)Pool_mark_cold, METH_O, "resident keys re-enter the order where it evicts first"},
    {"new_keys", (PyCFunction)Pool_new_keys, METH_O, "keys not resident or in flight, without duplicates"},
    {"can_place", (PyCFunction)(void (*)(void))Pool_can_place, METH_FASTCALL | METH_KEYWORDS, "would prepare_store succeed now?"},
    {"prepare_store", (PyCFunction)(void (*)(void))Pool_prepare_store, METH_FASTCALL | METH_KEYWORDS, "reserve slots (StorePlan) or None"},
    {"complete_store", (PyCFunction)(void (*)(void))Pool_complete_store, METH_FASTCALL | METH_KEYWORDS, "publish (success) or release reserved keys"},
    {"prepare_load", (PyCFunction)Pool_prepare_load, METH_O, "pin stored keys, return their slots"},
    {"complete_load", (PyCFunction)Pool_complete_load, METH_O, "unpin keys"},
    {"reset", (PyCFunction)Pool_reset, METH_NOARGS, "forget every idle key"},
    {"resident_keys", (PyCFunction)Pool_resident_keys, METH_NOARGS, NULL},
    {"free_count", (PyCFunction)Pool_free_count, METH_NOARGS, NULL},
    {"oldest", (PyCFunction)Pool_oldest, METH_NOARGS, "recency stamp of the page eviction takes next, or None"},
    {"older_than", (PyCFunction)(void (*)(void))Pool_older_than, METH_FASTCALL,
     "how many of the pages eviction takes first have a stamp below the given one (up to a limit)"},
    {"evict_lru", (PyCFunction)Pool_evict_lru, METH_O, "evict the n pages eviction takes first, or None"},
    {"set_capacity", (PyCFunction)Pool_set_capacity, METH_O,
     "grow, or shrink moving the pages past the end: [(key, from, to)], or None"},
    {"evictable_count", (PyCFunction)Pool_evictable_count, METH_NOARGS, NULL},
    {"slot_of", (PyCFunction)Pool_slot_of, METH_O, NULL},
    {"refs_of", (PyCFunction)Pool_refs_of, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Pool_members[] = {
    {"group_id", T_OBJECT, offsetof(Pool, group_id), READONLY, NULL},
    {"capacity", T_PYSSIZET, offsetof(Pool, capacity), READONLY, NULL},
    {"slots_used", T_PYSSIZET, offsetof(Pool, fresh), READONLY, "slots ever handed out, from 0 up"},
    {"target_t1", T_DOUBLE, offsetof(Pool, target_t1), 0, "ARC: how many resident keys T1 should hold"},
    {"stores", T_LONGLONG, offsetof(Pool, stores), 0, NULL},
    {"failed_stores", T_LONGLONG, offsetof(Pool, failed_stores), 0, NULL},
    {"evictions", T_LONGLONG, offsetof(Pool, evictions), 0, NULL},
    {"store_refusals", T_LONGLONG, offsetof(Pool, store_refusals), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods Pool_as_sequence = {
    .sq_length = (lenfunc)Pool_len,
    .sq_contains = (objobjproc)Pool_contains,
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hybridkv.ram._slotpool.SlotTable",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "SlotTable(group_id, capacity, policy='lru'): a slot pool in C",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_members = Pool_members,
    .tp_as_sequence = &Pool_as_sequence,
};

static PyObject *bind(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *v[4];
    if (!PyArg_ParseTuple(args, "OOOO", &v[0], &v[1], &v[2], &v[3]))
        return NULL;
    PyObject **dest[4] = {&MISS, &HIT, &HIT_PENDING, &PLAN};
    for (int i = 0; i < 4; i++)
        Py_XSETREF(*dest[i], Py_NewRef(v[i]));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(MISS, HIT, HIT_PENDING, StorePlan): the values to hand out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hybridkv.ram._slotpool",
    "The slot pool's hot path in C (see compiled_pool.py).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__slotpool(void) {
    if (PyType_Ready(&PoolType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "SlotTable", (PyObject *)&PoolType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

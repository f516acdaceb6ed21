import csv,collections,statistics as st,math
t=collections.defaultdict(dict)
for r in csv.DictReader(open('/work/.device/6/int4.csv')):
    if r['ms']: t[(r['shape'],int(r['m']),int(r['n']),int(r['k']))][r['impl']]=float(r['ms'])*1e3
S=132
def tok(m,n):
    if m<=64: return 64
    rows=-(-n//128)
    c64=math.ceil(-(-m//64)*rows/S)*0.8; c128=math.ceil(-(-m//128)*rows/S)
    return 64 if c64<c128 else 128
def gl(m,n):
    if m<=32: return False
    T=-(-m//64)*-(-n//128)
    return T >= (0.5 if m>=128 else 0.65)*S
bym=collections.defaultdict(list); worst=[]
for key,d in t.items():
    sh,m,n,k=key
    if 'w4a16_gluon_t64' not in d: continue
    pick = d['w4a16_gluon_t%d'%tok(m,n)] if gl(m,n) else d['w4a16_prepacked']
    best=min(d['w4a16_prepacked'],d['w4a16_gluon_t64'],d['w4a16_gluon_t128'])
    bym[m].append((d['w4a16_prepacked']/pick, pick/best, d['bf16_cublas']/pick, d['bf16_cublas']/d['w4a16_prepacked'], pick/d['int8_rowcol'], d['w4a16_prepacked']/d['int8_rowcol']))
    worst.append((pick/best,key))
for m in sorted(bym):
    v=bym[m]
    print('M=%d n=%d speedup vs decode median %.3f min %.3f max %.3f | off best median %.3f max %.3f | bf16/pick %.3f (was %.3f) | pick/int8 %.3f (was %.3f)'%(m,len(v),st.median(x[0] for x in v),min(x[0] for x in v),max(x[0] for x in v),st.median(x[1] for x in v),max(x[1] for x in v),st.median(x[2] for x in v),st.median(x[3] for x in v),st.median(x[4] for x in v),st.median(x[5] for x in v)))
worst.sort(); print(worst[-5:])
